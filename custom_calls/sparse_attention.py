"""Decode sparse attention for Hopper in Pallas Mosaic GPU (`sparse_attention`/`mosaic_gpu`).

Contract (deepinfer_fn.kernels.sparse_attention): q [B,S,H,d]; window_kv [B,Wk,d] (K = V);
window_bias [B,S,Wk] fp32 (0 / -inf); rows [B,N,d]; row_idx [B,S,K] int32 (-1 = masked);
sinks [H] fp32. One softmax over [window logits, row logits, sink], the sink's value zero.

Structure:
1. XLA (one fusion): for each query token t = (b, s) the key list
   keys[t] = [window_kv[b], rows[b, row_idx[b, s]], zero padding] ([T, L, d]) and its additive
   bias ([T, L] fp32: window_bias, 0 / -inf for the rows, -inf for the padding).
   The gather stays in XLA: Hopper's TMA cannot gather rows (that is Blackwell's
   `gather4`), and a wgmma operand in shared memory must sit in 8-row swizzled atoms, so
   a row-by-row gather would take 8 TMA copies a row; Pallas Mosaic GPU exposes no
   `cp.async` path on sm_90 either.
2. The flash-decode kernel of custom_calls/flash_decode.py (grid (T, splits), TMA-streamed
   keys, wgmma, online softmax), one key list a token, and its XLA merge of the splits
   with the sink logit.

Supported: bf16 / fp16 keys, d in {128, 256, 384, 512}, H a multiple of 8 and <= 64,
S <= 16 query tokens a sequence. Anything else falls back to the XLA reference.

Measured on an H200 (benchmarks/results/kernels_h200.json; H=32, d=512, Wk=128, K=512):
B=1 / 16 / 64: 12.3 / 20.5 / 49.2 us against XLA's 17.6 / 43.2 / 94.4 us. At B=64 the XLA
gather is 25 us of the 49 (it writes every selected row once more and the kernel reads it
back), the kernel 18 us (2.4 TB/s on the keys it streams): an in-kernel gather is the next
step, and on Hopper it needs per-thread `cp.async` / `ld.global` row copies, which this
Pallas version does not expose for sm_90.
"""

from __future__ import annotations

import jax.numpy as jnp

from custom_calls._common import on_hopper, round_up
from deepinfer_fn import kernels_xla
from custom_calls.flash_decode import flash_decode, plan, supported_geometry

MAX_TOKENS = 16  # S a sequence: decode and speculative verify. Larger S (prefill) would
# materialise the window once a token ([B*S, Wk + K, d]); the XLA reference serves it.


def supported(q, window_kv) -> bool:
    s, h, d = q.shape[-3:]
    return supported_geometry(h, d, window_kv.dtype) and s <= MAX_TOKENS


def gather_keys(window_kv, window_bias, rows, row_idx, block_k: int, multiple: int = 1):
    """keys [B*S, L, d] and bias [B*S, L] fp32, L = Wk + K rounded up to block_k * multiple."""
    b, s, k = row_idx.shape
    wk, d = window_kv.shape[1:]
    dtype = window_kv.dtype
    length = round_up(wk + k, block_k * multiple)
    gathered = jnp.take_along_axis(rows.astype(dtype)[:, None], jnp.maximum(row_idx, 0)[..., None],
                                   axis=2)
    keys = jnp.concatenate(
        [jnp.broadcast_to(window_kv[:, None], (b, s, wk, d)), gathered,
         jnp.zeros((b, s, length - wk - k, d), dtype)], axis=2)
    bias = jnp.concatenate(
        [window_bias.astype(jnp.float32), jnp.where(row_idx >= 0, 0.0, -jnp.inf),
         jnp.full((b, s, length - wk - k), -jnp.inf)], axis=2).astype(jnp.float32)
    return keys.reshape(b * s, length, d), bias.reshape(b * s, length)


def sparse_attention_mgpu(q, window_kv, window_bias, rows, row_idx, sinks, *,
                          interpret: bool = False, block_k: int = 64, stages: int = 2,
                          splits: int | None = None, qk_split: bool = True):
    """Registry signature (deepinfer_fn.kernels.sparse_attention); unsupported inputs (see
    `supported`) are served by the XLA reference."""
    if not supported(q, window_kv):
        return kernels_xla.sparse_attention(q, window_kv, window_bias, rows, row_idx, sinks)
    b, s, h, d = q.shape
    t_count = b * s
    splits, length = plan(t_count, window_kv.shape[1] + row_idx.shape[-1], block_k, splits,
                          interpret)
    keys, bias = gather_keys(window_kv, window_bias, rows, row_idx, block_k, length // block_k)
    o = flash_decode(q.reshape(t_count, h, d), keys, bias, sinks, splits=splits, block_k=block_k,
                     stages=stages, qk_split=qk_split, interpret=interpret)
    return o.reshape(b, s, h, d)


sparse_attention_mgpu.available = on_hopper
