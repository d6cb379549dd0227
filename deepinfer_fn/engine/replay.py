"""How approximate SWA bounded replay is (docs/MODEL.md §7).

On a prefix-cache hit at h the engine keeps the cached compressed rows of positions < h and
rebuilds the sliding-window ring and compressor rings by replaying only the R tokens
h-R .. h-1 with row writes below h suppressed (`row_floor`), then prefills the rest. This
module runs exactly that recipe on the contiguous `DecodeState` (the same `forward_chunk`
the engine's sub-step calls) next to an exact full prefill, and compares the logits of the
last prompt token and of a teacher-forced continuation.

Why it is approximate: replayed position h-R+k sees k+1 window keys instead of W in every
layer (layer 0's KV stays exact); the error is confined to the window branch (the rows are
exact) and decays as the continuation moves past h: the dependency cone grows by W-1
positions per layer, so positions >= h - R + L (W - 1) are exact again (all L layers are
in the cone). R >= h is exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_fn.model import transformer
from deepinfer_fn.state import DecodeState, init_state


@jax.jit
def _chunk(params, state, ids, floor):
    B, S = ids.shape
    logits, state, _ = transformer.forward_chunk(
        params, state, ids, jnp.full((B,), S, jnp.int32), all_logits=True,
        row_floor=jnp.full((B,), floor, jnp.int32))
    return logits, state


def _run(params, state, tokens, start, floor, chunk):
    logits = []
    for off in range(start, len(tokens), chunk):
        ids = jnp.asarray(np.asarray(tokens[off:off + chunk], np.int32)[None])
        lg, state = _chunk(params, state, ids, jnp.int32(floor))
        logits.append(np.asarray(lg[0]))
    return np.concatenate(logits, 0), state


def replay_logits(params, tokens, hit: int, replay: int | None, *, chunk: int = 64,
                  max_len: int | None = None) -> np.ndarray:
    """float32 [len(tokens) - hit, V]: the logits at positions hit .. end-1 when the state at
    `hit` is rebuilt the engine's way: cached rows of the prefix + replay of tokens
    hit-R .. hit-1 (row writes below hit suppressed), then the rest of `tokens` (teacher
    forced). replay=None: exact (a full prefill from position 0)."""
    cfg = params.config
    tokens = list(tokens)
    if not 0 < hit < len(tokens):
        raise ValueError(f"hit={hit} must be inside the sequence (length {len(tokens)})")
    cap = max_len or max(256, 1 << (len(tokens) - 1).bit_length())
    if replay is None:
        exact, _ = _run(params, init_state(cfg, 1, cap, dtype=params.dtype), tokens, 0, 0, chunk)
        return exact[hit:]
    # The cached rows: a prefill of the prefix alone (what the request that cached it wrote).
    _, cached = _run(params, init_state(cfg, 1, cap, dtype=params.dtype), tokens[:hit], 0, 0, chunk)
    start = max(0, hit - replay)
    fresh = init_state(cfg, 1, cap, dtype=params.dtype)
    layers = fresh.layers.map_blocks(
        lambda scanned, layer, old: {k: (old[k] if k in ("rows", "index_rows") else v)
                                     for k, v in layer.items()}, cached.layers)
    state = DecodeState(layers, jnp.full((1,), start, jnp.int32), fresh.max_len, fresh.window_slots)
    approx, _ = _run(params, state, tokens, start, hit, chunk)
    return approx[hit - start:]


def replay_divergence(params, tokens, hit: int, replay: int, *, chunk: int = 64,
                      max_len: int | None = None) -> dict:
    """Logit divergence of bounded replay vs exact prefill for one sequence `tokens`.

    hit: cached prefix length h (the engine's is page-aligned); replay: R. Positions h .. end-1
    of `tokens` are scored (teacher-forced: the prompt suffix and any continuation are both in
    `tokens`). Returns max_abs (max |dlogit| over those positions), first_abs (at position h),
    last_abs (at the last position), per_position max |dlogit| and top1_agreement (fraction of
    positions whose argmax agrees).
    """
    exact = replay_logits(params, tokens, hit, None, chunk=chunk, max_len=max_len)
    approx = replay_logits(params, tokens, hit, replay, chunk=chunk, max_len=max_len)
    per_pos = np.abs(approx - exact).max(-1)
    agree = approx.argmax(-1) == exact.argmax(-1)
    return dict(hit=hit, replay=replay, max_abs=float(per_pos.max()), first_abs=float(per_pos[0]),
                last_abs=float(per_pos[-1]), per_position=per_pos.tolist(),
                top1_agreement=float(agree.mean()), logit_scale=float(np.abs(exact).max()))
