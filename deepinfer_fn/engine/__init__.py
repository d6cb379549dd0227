"""Offline engine (issue 5): continuous batching over a paged state, prefix cache with SWA
bounded replay, asynchronous scheduling. Entry point: `Engine` (engine.py)."""

from deepinfer_fn.engine.engine import Engine, RunMetrics, StreamEvent
from deepinfer_fn.engine.request import Request, RequestMetrics, RequestOutput
from deepinfer_fn.engine.transfer import RequestState

__all__ = ["Engine", "RunMetrics", "StreamEvent", "Request", "RequestMetrics", "RequestOutput",
           "RequestState"]
