"""Chunked prefill of right-padded prompts, and the shape buckets generate's programs use.

A prompt batch tokens [B, T] with real lengths [B] is fed in chunks of `prefill_width(T,
chunk)` columns; row b takes its lengths[b] tokens and then nothing (n_new = 0: state
unchanged). The logits of each row's last prompt token are kept from the chunk it ends in.
With `bounded_replay` (DeepSeek-V4.1's decoder SWA bounded replay, docs/MODEL.md §V3-V4)
every chunk is a `replay_v41.extend`: the late layers run on the chunk's last sliding_window
rows only, their window floored there; decode steps and verify chunks run every row.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_fn.model import replay_v41, transformer
from deepinfer_fn.params import Params
from deepinfer_fn.program_cache import program
from deepinfer_fn.state import DecodeState, init_state

# An empty decode state in one program (eagerly, each array would compile its own).
empty_state = program(init_state, static_argnums=(0, 1, 2),
                      static_argnames=("window_slots", "dtype"), name="empty_state")


def bucket(n: int, minimum: int = 256) -> int:
    """Round a capacity up to a power of two (at least `minimum`) so repeated calls reuse
    compiled programs."""
    return max(minimum, 1 << (int(n) - 1).bit_length())


def prefill_width(prompt_len: int, chunk: int) -> int:
    """Width of generate's prefill chunks: the prompt length rounded up to a power of two
    (at least 16), capped at `chunk`, so prompts of similar lengths share one program."""
    return max(1, min(int(chunk), bucket(prompt_len, 16)))


def prefill_chunks(tokens: np.ndarray, lengths: np.ndarray, chunk: int):
    """Chunks of right-padded prompts tokens [B,T]: yields (ids int32 [B,c] on the device,
    next ids [B,c] numpy (the tokens one position later, padding past T), n_new [B] numpy,
    ends_here bool [B] numpy (the row's prompt ends in this chunk)) while some row still has
    tokens. The chunk width c is `prefill_width(T, chunk)`."""
    T = tokens.shape[1]
    chunk = prefill_width(T, chunk)
    padded = -(-T // chunk) * chunk
    tokens = np.pad(tokens, ((0, 0), (0, padded + 1 - T)))
    for off in range(0, padded, chunk):
        n_new = np.clip(lengths - off, 0, chunk).astype(np.int32)
        if not n_new.any():
            return
        yield (jax.device_put(tokens[:, off:off + chunk]), tokens[:, off + 1:off + chunk + 1], n_new,
               (lengths > off) & (lengths <= off + chunk))


def keep_last(prev, new, ends_here):
    """Per row, `new` where the row's prompt ends in this chunk, else `prev` (pytrees of
    arrays [B, ...]; prev None: the first chunk)."""
    if prev is None:
        return new
    ends_here = jnp.asarray(ends_here)
    pick = lambda n, p: jnp.where(ends_here.reshape((-1,) + (1,) * (n.ndim - 1)), n, p)
    return jax.tree.map(pick, new, prev)


# Prefill chunks of at most this many tokens (rows x width) compile with
# `program_cache.QUICK_COMPILE_OPTIONS`: their run time is negligible, their compile is not.
QUICK_COMPILE_MAX_TOKENS = 64


def is_small_chunk(params, state, chunk, *args, **kwargs) -> bool:
    """Whether a prefill chunk [B, c] has at most QUICK_COMPILE_MAX_TOKENS tokens."""
    return chunk.shape[0] * chunk.shape[1] <= QUICK_COMPILE_MAX_TOKENS


@program(donate_argnums=(1,), static_argnames=("bounded_replay",), quick_compile=is_small_chunk)
def prefill_forward(params: Params, state: DecodeState, chunk, n_new, *,
                    bounded_replay: bool = False):
    """One prefill chunk [B, c] against the state (donated): (last-token logits [B,V], state).
    bounded_replay: a V4.1 extend with decoder SWA bounded replay (tail = sliding_window)."""
    if bounded_replay:
        return replay_v41.extend(params, state, chunk, n_new, decoder_swa_bounded_replay=True)
    logits, state, _ = transformer.forward_chunk(params, state, chunk, n_new)
    return logits, state


def prefill(params: Params, state: DecodeState, tokens: np.ndarray, lengths: np.ndarray,
            chunk: int, *, bounded_replay: bool = False):
    """Chunked prefill of right-padded prompts; returns (last-token logits [B,V], state)."""
    last = None
    for ids, _, n_new, ends_here in prefill_chunks(tokens, lengths, chunk):
        logits, state = prefill_forward(params, state, ids, jax.device_put(n_new),
                                        bounded_replay=bounded_replay)
        last = keep_last(last, logits, ends_here)
    return last, state
