"""Prefill chunk attention for Hopper in Pallas Mosaic GPU (`chunk_attention`/`mosaic_gpu`).

Contract: deepinfer_fn.kernels.chunk_attention (a chunk of S new tokens over its sliding
window plus optional extra keys shared by a row's tokens, one softmax with the sink, K = V).

Structure:
1. XLA: the blocked window of the chunk (`kernels_xla.window_blocks`: query blocks of Q
   tokens, each with the R + Q window keys its tokens can see) and one key list a block:
   keys[b, i] = [window keys of block i | the row's extra keys, zero-padded to whole key
   blocks] ([B*nb, L, d]), with each token's additive bias [B*Sp, L] fp32 (0 / -inf).
   That is (R + Q + N) x d keys a block instead of S x H x (R + Q + N) fp32 logits.
2. The flash kernel of custom_calls/flash_decode.py with P = 64 / H tokens a CTA (their
   P x H query rows fill one wgmma tile and share every key block they load), one split,
   the sink folded into the softmax: its output is the result. A CTA visits only the key
   blocks some of its tokens can see (about 3 of the window's and the visible prefix of
   the extra keys).
3. A raw query (`q_norm_eps`, `q_rope`): the kernel prepares its query tile in shared
   memory (flash_decode's `norm_eps` / `rope`: each row's head RMS factor scales its logits,
   the 64 rotated channels are rewritten before the first q @ K^T), so XLA does not touch
   the query at all. For other rotation widths XLA reads the query once for the factors and
   rewrites only its rotated channels, in place (`folded_query`). The reference normalises
   and rotates the whole query first (two more passes over it); the results agree to bf16
   rounding.

Supported (`supported`): bf16 / fp16 keys, d in {128, 256, 384, 512}, H dividing 64 with
H >= 8, chunks of more than MIN_TOKENS tokens, no extra keys or extra keys shared by the
row ([B,N,d]) with materialised key lists of at most MAX_KEY_BYTES. Everything else (decode
and verify chunks, per-token extra keys) is served by the XLA reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from custom_calls._common import on_hopper, round_up
from custom_calls.flash_decode import flash_decode, prepares_query, supported_geometry
from deepinfer_fn import kernels_xla
from deepinfer_fn.model.common import head_rms_factor
from deepinfer_fn.model.rope import apply_rope_in_place

MIN_TOKENS = 16               # shorter chunks (decode, verify) go through the decode kernels
# False: `folded_query` always (`benchmarks/variants.py prefill --variants
# default,query_folded` compares the two). Read while tracing: programs compiled before a
# change (and program_cache entries) keep their form.
PREPARE_QUERY_IN_KERNEL = True
MAX_KEY_BYTES = 1 << 30       # the per-block key lists this path materialises


def _key_bytes(b: int, s: int, window: int, r: int, n: int, d: int, itemsize: int,
               block_k: int) -> int:
    qb = kernels_xla.chunk_block_size(window)
    nb = -(-s // qb)
    return b * nb * round_up(r + qb + n, block_k) * d * itemsize


def supported(q, kv, ring_kv, window: int, extra_keys=None, block_k: int = 64) -> bool:
    """Whether `chunk_attention_mgpu` runs the kernel for these inputs."""
    b, s, h, d = q.shape
    n = 0 if extra_keys is None else extra_keys.shape[1]
    return (supported_geometry(h, d, kv.dtype) and 64 % h == 0 and s > MIN_TOKENS
            and (extra_keys is None or extra_keys.ndim == 3)
            and ring_kv.shape[1] >= window
            and _key_bytes(b, s, window, ring_kv.shape[1], n, d, kv.dtype.itemsize,
                           block_k) <= MAX_KEY_BYTES)


def block_keys(kv, start, n_new, ring_kv, ring_pos, window: int, extra_keys, extra_bias,
               key_floor, block_k: int):
    """(keys [B*nb, L, d], bias [B*Sp, L] fp32, Q): each query block's key list (its window
    keys, then the row's extra keys), L a multiple of block_k, -inf on every padding key."""
    k_blk, ok = kernels_xla.window_blocks(kv, start, n_new, ring_kv, ring_pos, window,
                                          key_floor)
    b, nb, qb, lw = ok.shape
    sp = nb * qb
    d = kv.shape[-1]
    n = 0 if extra_keys is None else extra_keys.shape[1]
    length = round_up(lw + n, block_k)
    parts = [k_blk]
    bias = [jnp.where(ok, 0.0, -jnp.inf).reshape(b, sp, lw)]
    if extra_keys is not None:
        parts.append(jnp.broadcast_to(extra_keys.astype(kv.dtype)[:, None], (b, nb, n, d)))
        bias.append(jnp.pad(extra_bias.astype(jnp.float32),
                            ((0, 0), (0, sp - extra_bias.shape[1]), (0, 0))))
    parts.append(jnp.zeros((b, nb, length - lw - n, d), kv.dtype))
    bias.append(jnp.full((b, sp, length - lw - n), -jnp.inf, jnp.float32))
    keys = jnp.concatenate(parts, axis=2).reshape(b * nb, length, d)
    return keys, jnp.concatenate(bias, axis=2).reshape(b * sp, length), qb


def folded_query(q, q_norm_eps, q_rope):
    """(q', scale [B,S,H] or None) with q' * scale = `kernels_xla.prepared_query(q, ...)` up
    to rounding: the head RMS factor becomes a scale of the row's logits, and only the
    rotated channels are rewritten (in place), instead of passes that rewrite the whole
    query."""
    scale = None
    if q_norm_eps is not None:
        scale = head_rms_factor(q, q_norm_eps)[..., 0]
        # The factor is read before the in-place rotation overwrites q's channels: without
        # the ordering XLA copies q to keep the factor's input alive.
        q, scale = jax.lax.optimization_barrier((q, scale))
    if q_rope is not None:
        cos, sin = q_rope
        q = apply_rope_in_place(q, cos[:, :, None], sin[:, :, None])
    return q, scale


def chunk_attention_mgpu(q, kv, start, n_new, ring_kv, ring_pos, sinks, *, window: int,
                         extra_keys=None, extra_bias=None, key_floor=None, q_norm_eps=None,
                         q_rope=None, interpret: bool = False, block_k: int = 64,
                         stages: int = 2, skip_masked: bool = True):
    """Registry signature (deepinfer_fn.kernels.chunk_attention); unsupported inputs (see
    `supported`) are served by the XLA reference. A raw query (q_norm_eps, q_rope) is
    prepared by the kernel (`flash_decode.prepares_query`), else by `folded_query`."""
    if not supported(q, kv, ring_kv, window, extra_keys, block_k):
        return kernels_xla.chunk_attention(q, kv, start, n_new, ring_kv, ring_pos, sinks,
                                           window=window, extra_keys=extra_keys,
                                           extra_bias=extra_bias, key_floor=key_floor,
                                           q_norm_eps=q_norm_eps, q_rope=q_rope)
    b, s, h, d = q.shape
    rope = 0 if q_rope is None else 2 * q_rope[0].shape[-1]
    in_kernel = PREPARE_QUERY_IN_KERNEL and prepares_query(d, rope)
    scale, lanes = None, None
    if in_kernel:
        if q_rope is not None:
            lanes = tuple(a.reshape(b, s, rope // 2) for a in q_rope)
    else:
        q, scale = folded_query(q, q_norm_eps, q_rope)
    keys, bias, qb = block_keys(kv, start, n_new, ring_kv, ring_pos, window, extra_keys,
                                extra_bias, key_floor, block_k)
    sp = bias.shape[0] // b
    pad = lambda a: jnp.pad(a, ((0, 0), (0, sp - s)) + ((0, 0),) * (a.ndim - 2))
    q_p = pad(q.astype(kv.dtype))
    o = flash_decode(q_p.reshape(b * sp, h, d), keys, bias, sinks, tokens_per_key=qb,
                     splits=1, block_k=block_k, stages=stages, tokens_per_cta=64 // h,
                     skip_masked=skip_masked,
                     q_scale=None if scale is None else pad(scale).reshape(b * sp, h),
                     q_norm_eps=q_norm_eps if in_kernel else None,
                     q_rope=None if lanes is None else
                     tuple(pad(a).reshape(b * sp, rope // 2) for a in lanes),
                     interpret=interpret)
    return o.reshape(b, sp, h, d)[:, :s]


def chunk_attention_prefers(q, kv, start, n_new, ring_kv, ring_pos, sinks, *, window: int,
                            extra_keys=None, **_) -> bool:
    """The platform preference takes the kernel wherever it is supported."""
    return supported(q, kv, ring_kv, window, extra_keys)


chunk_attention_mgpu.available = on_hopper
chunk_attention_mgpu.prefers = chunk_attention_prefers
