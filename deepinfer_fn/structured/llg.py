"""The llguidance package: its import (a clear error when missing), one shared parallel
executor for batched masks, and the first line of its error messages."""

from __future__ import annotations

_EXECUTOR = None


def module():
    """The `llguidance` module; ImportError naming the package when it is not installed."""
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - a dependency
        raise ImportError("structured output needs the 'llguidance' package "
                          "(pip install 'llguidance>=1.9')") from e
    return llguidance


def executor():
    """The process-wide `llguidance.LLExecutor` (computes many matchers' masks in parallel)."""
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = module().LLExecutor()
    return _EXECUTOR


def short_message(message: str) -> str:
    """The first line of an error (llguidance's verbose state dump after it dropped),
    whitespace collapsed; "unknown error" when empty."""
    line = message.strip().split("\n<state>")[0].strip()
    return " ".join(line.split()) or "unknown error"
