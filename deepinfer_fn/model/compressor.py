"""KV compressor: softmax-gated pooling of m-token windows into one row (spec §2.6).

HCA (c = 1): row w pools the m tokens of window w. CSA (c = 2, overlapping): row w pools the
A-halves (first `dim` channels) of window w-1 and the B-halves of window w. Rows are
RMS-normalised and rotated (compress RoPE) at position m*w, the window's first token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_fn.model.common import linear, rms_norm
from deepinfer_fn.model.rope import apply_rope, rope_cos_sin


def project(p, x: jax.Array, positions: jax.Array, ratio: int):
    """Raw per-token compressor inputs: kappa [B,T,c*dim] (act dtype), gate + ape [B,T,c*dim] fp32."""
    kappa = linear(x, p["wkv"])
    gate = linear(x, p["wgate"]).astype(jnp.float32)
    gate = gate + p["ape"].astype(jnp.float32)[positions % ratio]
    return kappa, gate


def pool_windows(kappa, gate, overlap: bool, prev_kappa_a=None, prev_gate_a=None):
    """Per-channel softmax pooling of complete windows.

    kappa/gate: [B, N, m, c*dim] for N consecutive windows. For CSA, the A-candidates of the
    first window come from `prev_*_a` [B, m, dim] (the window before it) or, if None, do not
    exist (kappa 0, gate -inf). Returns pooled [B, N, dim] in kappa's dtype.
    """
    if overlap:
        dim = kappa.shape[-1] // 2
        ka, kb = kappa[..., :dim], kappa[..., dim:]
        ga, gb = gate[..., :dim], gate[..., dim:]
        if prev_kappa_a is None:
            prev_kappa_a = jnp.zeros_like(ka[:, :1])[:, 0]
            prev_gate_a = jnp.full_like(ga[:, :1], -jnp.inf)[:, 0]
        ka_prev = jnp.concatenate([prev_kappa_a[:, None], ka[:, :-1]], axis=1)
        ga_prev = jnp.concatenate([prev_gate_a[:, None], ga[:, :-1]], axis=1)
        kappa = jnp.concatenate([ka_prev, kb], axis=2)   # [B, N, 2m, dim]
        gate = jnp.concatenate([ga_prev, gb], axis=2)
    weights = jax.nn.softmax(gate, axis=2).astype(kappa.dtype)
    pooled = jnp.sum(weights.astype(jnp.float32) * kappa.astype(jnp.float32), axis=2)
    return pooled.astype(kappa.dtype)


def finish_rows(p, pooled, window_index, ratio: int, freqs, eps: float):
    """RMSNorm + compress RoPE at position ratio * window_index: [B, N, dim] -> rows."""
    rows = rms_norm(pooled, p["norm"], eps, out_dtype=pooled.dtype)
    cos, sin = rope_cos_sin(window_index * ratio, freqs, rows.dtype)
    return apply_rope(rows, cos, sin)


def compress_sequence(p, x, ratio: int, overlap: bool, freqs, eps: float):
    """All complete-window rows of a sequence starting at position 0: x [B,T,D] -> [B, T//m, dim].

    The trailing incomplete window produces nothing (§2.6, §3.3).
    """
    B, T, _ = x.shape
    n_rows = T // ratio
    positions = jnp.arange(T)
    kappa, gate = project(p, x, positions, ratio)
    width = kappa.shape[-1]
    if n_rows == 0:
        dim = width // 2 if overlap else width
        return jnp.zeros((B, 0, dim), kappa.dtype)
    used = n_rows * ratio
    kappa = kappa[:, :used].reshape(B, n_rows, ratio, width)
    gate = gate[:, :used].reshape(B, n_rows, ratio, width)
    pooled = pool_windows(kappa, gate, overlap)
    return finish_rows(p, pooled, jnp.arange(n_rows), ratio, freqs, eps)
