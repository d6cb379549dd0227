"""Host callbacks of the jitted decode loops: a registry of live `ConstrainedBatch`es, looked up
by an int32 session id, and the `io_callback` targets that advance them.

The packed masks of step i are part of the loop carry; after sampling step i, one unordered
`io_callback` (the data dependency token_i -> mask_{i+1} -> token_{i+1} already orders the calls,
and unordered callbacks also work under a multi-device mesh) hands the tokens to the host, which
advances the matchers and returns mask_{i+1} and the rows the constraint finished. The targets
are module-level functions and the batch is a session id, so a program compiles once per shape,
not per request; unconstrained calls trace no callback and no mask. Neither XLA:CPU nor a GPU
stream runs the callback concurrently with the step's forward pass, so the host work is on the
critical path. Speculative loops call `host_draft` once per draft slot and `host_commit` at the
end of each verify step (`ConstrainedBatch.draft_step`, `ConstrainedBatch.commit`).

The targets never raise: a host failure ends the affected rows with an error
("host mask step failed: ...") instead of taking down the device loop.
"""

from __future__ import annotations

import itertools

import numpy as np

from deepinfer_fn.structured.batch import ConstrainedBatch

_SESSIONS: dict[int, ConstrainedBatch] = {}
_SESSION_IDS = itertools.count(1)


def register(batch: ConstrainedBatch) -> int:
    """A new session id (int32 range) for `batch`, the callbacks' handle on it."""
    sid = next(_SESSION_IDS) & 0x7FFFFFFF
    _SESSIONS[sid] = batch
    return sid


def unregister(sid: int):
    _SESSIONS.pop(sid, None)


def _failure_message(e: Exception) -> str:
    return f"host mask step failed: {type(e).__name__}: {e}"


def host_draft(session, tokens, active):
    """io_callback target of a speculative draft slot: (session id, draft tokens [B], active
    [B]) -> (packed masks [B,W] uint32 after the drafts so far, stop [B] bool: admit no later
    slot). Never raises: a failure marks the affected rows as errors (reported at commit)."""
    batch = _SESSIONS[int(session)]
    try:
        return batch.draft_step(tokens, active)
    except Exception as e:  # noqa: BLE001 - a host failure must not take down the device loop
        return batch.fail(_failure_message(e), halt=True)


def host_commit(session, tokens, accepted, n_emit, active):
    """io_callback target of a speculative verify step's end: (session id, emitted tokens
    [B,k+1], accepted drafts g [B], committed count [B], active [B]) -> (packed masks [B,W]
    uint32 for the next step, finished [B] bool, n_keep [B] int32). Never raises."""
    batch = _SESSIONS[int(session)]
    try:
        return batch.commit(tokens, accepted, n_emit, active)
    except Exception as e:  # noqa: BLE001
        masks, finished = batch.fail(_failure_message(e))
        return masks, finished, np.where(np.asarray(active, bool), n_emit, 0).astype(np.int32)


def host_step(session, tokens, active):
    """io_callback target: (session id, sampled tokens [B], active [B]) -> (packed masks [B,W]
    uint32, finished [B] bool). Never raises: a failure marks the affected rows as errors."""
    batch = _SESSIONS[int(session)]
    try:
        return batch.step(tokens, active)
    except Exception as e:  # noqa: BLE001 - a host failure must not take down the device loop
        return batch.fail(_failure_message(e))
