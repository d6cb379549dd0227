"""Offline batches in the API formats people already have (OpenAI chat completions and
Responses, Anthropic Messages, and their batch-file lines), through deepseek-recipe.

    from deepinfer_fn import batch
    for r in batch.run_batch(lines):                 # dicts or JSON strings; default model
        r.custom_id, r.line                          # result lines, as requests finish
    for ev in batch.stream_batch(lines): ...         # + recipe stream chunks / events
    batch.run_batch_file("requests.jsonl", "responses.jsonl", resume=True)

Modules: `envelopes` (line shapes in and out), `formats` (recipe conversion, engine request,
response building), `encodings` (V4 / V4.1 encoding from config.json), `model` (params +
tokenizer + chat format + drafter), `runner` (the engine loop), `resume` (partial output
files), `batchfile` (JSONL in, JSONL out).
"""

from deepinfer_fn.batch.batchfile import run_batch_file
from deepinfer_fn.batch.encodings import FAMILIES, family_of
from deepinfer_fn.batch.model import BatchModel, load_batch_model
from deepinfer_fn.batch.runner import BatchEvent, BatchResult, make_engine, run_batch, stream_batch

__all__ = ["run_batch", "stream_batch", "run_batch_file", "BatchResult", "BatchEvent",
           "BatchModel", "load_batch_model", "make_engine", "FAMILIES", "family_of"]
