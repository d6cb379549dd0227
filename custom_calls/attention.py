"""Dense decode / verify attention for Hopper in Pallas Mosaic GPU (`attention`/`mosaic_gpu`).

Contract (deepinfer_fn.kernels.attention, spec §2.8): q [B,T,H,d]; keys [B,S,d] (K = V);
bias [B,T,S] fp32 additive (0 / -inf); sinks [H] fp32 -> o [B,T,H,d] in keys' dtype. One
softmax over [q.k / sqrt(d) + bias, sink], the sink's value zero. SWA layers call it with the
window ring plus the chunk's keys, HCA layers with those plus the compressed rows.

The computation is the flash-decode kernel of custom_calls/flash_decode.py with one key list
per sequence, shared by its T query tokens (`tokens_per_key=T`: no per-token copy of the
keys, a CTA reads its sequence's keys straight from `keys`). XLA around it: keys padded to a
multiple of 8 rows only when S is not one (the tiled TMA layout; the copy engine zero-fills
the last block's rows past that), bias padded with -inf to whole key blocks, and the merge of
the key splits with the sink.

Supported (`supported`): bf16 / fp16 keys, d in {128, 256, 384, 512}, H a multiple of 8 and
<= 64, T <= MAX_TOKENS query tokens a sequence (decode and speculative verify). Everything
else, prefill tiles (T > MAX_TOKENS) included, is served by the XLA reference
(`deepinfer_fn.kernels_xla.attention`): a CTA per query token streams all S keys, which for
a prefill tile (S ~ T keys, T tokens) reads the keys T times. Prefill chunks go through
`chunk_attention` instead (custom_calls/chunk_attention.py: the same flash kernel, several
tokens a CTA, the blocked window's key lists).
"""

from __future__ import annotations

import jax.numpy as jnp

from custom_calls._common import on_hopper, round_up
from deepinfer_fn import kernels_xla
from custom_calls.flash_decode import flash_decode, plan, supported_geometry

MAX_TOKENS = 16  # T a sequence served by the kernel: decode and speculative verify.


def supported(q, keys, bias) -> bool:
    """Whether `attention_mgpu` runs the kernel for these inputs (else the XLA reference)."""
    b, t, h, d = q.shape
    return (supported_geometry(h, d, keys.dtype) and t <= MAX_TOKENS and keys.ndim == 3
            and keys.shape[0] == b and keys.shape[2] == d and keys.shape[1] >= 1
            and bias.shape == (b, t, keys.shape[1]))


def pad_keys(keys, bias, length: int):
    """keys [B,S,d] -> [B,Lk,d], Lk = S rounded up to 8 (S if it is a multiple of 8 or <= 8,
    length if that is smaller); bias [B,T,S] -> [B*T, length] fp32, -inf past S."""
    b, s, _ = keys.shape
    t = bias.shape[1]
    lk = s if (s <= 8 or s % 8 == 0) else min(round_up(s, 8), length)
    if lk != s:
        keys = jnp.pad(keys, ((0, 0), (0, lk - s), (0, 0)))
    bias = jnp.pad(bias.astype(jnp.float32), ((0, 0), (0, 0), (0, length - s)),
                   constant_values=-jnp.inf)
    return keys, bias.reshape(b * t, length)


def attention_mgpu(q, keys, bias, sinks, *, interpret: bool = False, block_k: int = 64,
                   stages: int = 2, splits: int | None = None, qk_split: bool = True):
    """Registry signature (deepinfer_fn.kernels.attention); unsupported inputs (see
    `supported`) are served by the XLA reference."""
    if not supported(q, keys, bias):
        return kernels_xla.attention(q, keys, bias, sinks)
    b, t, h, d = q.shape
    splits, length = plan(b * t, keys.shape[1], block_k, splits, interpret)
    keys_p, bias_p = pad_keys(keys, bias, length)
    o = flash_decode(q.reshape(b * t, h, d), keys_p, bias_p, sinks, tokens_per_key=t,
                     splits=splits, block_k=block_k, stages=stages, qk_split=qk_split,
                     interpret=interpret)
    return o.reshape(b, t, h, d)


attention_mgpu.available = on_hopper
