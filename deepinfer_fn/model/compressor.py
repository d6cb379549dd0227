"""KV compressor: softmax-gated pooling of m-token windows into one row (spec §2.6).

HCA (c = 1): row w pools the m tokens of window w. CSA (c = 2, overlapping): row w pools the
A-halves (first `dim` channels) of window w-1 and the B-halves of window w. Rows are
RMS-normalised and rotated (compress RoPE) at position m*w, the window's first token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_fn import kernels
from deepinfer_fn.model.common import linear, rms_norm
from deepinfer_fn.model.rope import apply_rope, rope_cos_sin


def project(p, x: jax.Array, positions: jax.Array, ratio: int):
    """Raw per-token compressor inputs: kappa [B,T,c*dim] (act dtype), gate + ape [B,T,c*dim]
    fp32."""
    return inputs_of(p, linear(x, p["wkv"]), linear(x, p["wgate"]), positions, ratio)


def inputs_of(p, kappa: jax.Array, x_wgate: jax.Array, positions: jax.Array, ratio: int):
    """`project` from the input's projections kappa = x @ wkv and x @ wgate [B,T,c*dim]."""
    gate = x_wgate.astype(jnp.float32) + p["ape"].astype(jnp.float32)[positions % ratio]
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


def compressor_decode_step(params, x, position, rings, ratio: int, freqs, eps: float,
                           active=None, row_floor=None):
    """One decode token (S = 1) through all compressors of a layer at once (§2.6, §3.2):
    `compressor_chunk` for S = 1, as the fused registry op `kernels.compressor_decode`.

    params: tuple of compressor param dicts (CSA: (main, indexer); HCA: (main,));
    x [B, D] (attention input); position [B] int32 (= start); rings: per compressor
    (raw_kv [B, R, c*d], raw_gate [B, R, c*d] fp32), the layer's rings before this token;
    active [B] bool (n_new > 0; default all); row_floor [B] (optional, as in
    `compressor_chunk`). Returns one dict per compressor:
      raw_kv [B, c*d], raw_gate [B, c*d] fp32: write at ring slot `slot`;
      slot [B] int32: position % R, or R (out of range: write nothing) where not active;
      row [B, d]: the row of window row_index = position // m; write it at `row_index`
        only where `complete` (active, the token closes the window, above row_floor).
    """
    assert x.ndim == 2 and position.shape == x.shape[:1], (x.shape, position.shape)
    assert len(params) == len(rings) >= 1
    position = position.astype(jnp.int32)
    active = jnp.ones(position.shape, bool) if active is None else active
    row_index = position // ratio
    complete = active & ((position + 1) % ratio == 0)
    if row_floor is not None:
        complete &= row_index >= row_floor // ratio
    outs = kernels.compressor_decode(x, position, tuple(params), tuple(rings), ratio, freqs, eps)
    steps = []
    for (kappa, gate, row), (ring_kv, _) in zip(outs, rings):
        slots = ring_kv.shape[1]
        steps.append(dict(raw_kv=kappa, raw_gate=gate,
                          slot=jnp.where(active, position % slots, slots).astype(jnp.int32),
                          row=row, row_index=row_index, complete=complete))
    return steps
