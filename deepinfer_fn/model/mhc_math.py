"""mHC math of one module: mixing weights, Sinkhorn, collapse, expand (spec §2.3).

Pure functions on arrays, importable by the kernel registry (deepinfer_fn.kernels holds the
registered `mhc_pre` / `mhc_post` ops built from these); deepinfer_fn.model.mhc is the
model-facing layer on top.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from deepinfer_fn.model.common import rms


def stream_logits(streams: jax.Array, fn: jax.Array, eps: float) -> jax.Array:
    """u = fn . rms(flatten(X)) for every token: [..., n, D] -> [..., n_out], fp32."""
    flat = streams.reshape(*streams.shape[:-2], -1)
    z = rms(flat, eps)
    return jnp.matmul(z, fn.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def sinkhorn(logits: jax.Array, iters: int, eps: float) -> jax.Array:
    """Row softmax, then alternate column/row normalisation, ending on columns (§2.3 step 5).

    logits: [..., n, n] (row j, column k) -> P with columns summing to ~1.
    Every normalisation is written over the last axis, of P or of its transpose (a column
    normalisation of P is a row normalisation of P^T): XLA:GPU fuses the whole unrolled chain
    into one kernel either way, and analyses this form faster. Sums written as explicit
    adds of slices split into two GPU kernels per iteration instead of fusing.
    """
    def rows(m):
        return m / (m.sum(axis=-1, keepdims=True) + eps)

    t = jnp.swapaxes(jax.nn.softmax(logits, axis=-1) + eps, -1, -2)     # P^T
    t = rows(t)
    # Unrolled: as a loop, each of the 19 iterations would be separate tiny kernels (and, on
    # GPU, a host round trip for the loop condition) in every mHC module of every step.
    for _ in range(iters - 1):
        t = jnp.swapaxes(rows(jnp.swapaxes(t, -1, -2)), -1, -2)
        t = rows(t)
    # The barrier materialises P: XLA:GPU's priority fusion would otherwise fuse the unrolled
    # chain into every consumer of P ([N, n, D] expand), recomputing it per element, and the
    # fusion pass itself runs for minutes. With it, the Sinkhorn is a few kernels of its own.
    return jax.lax.optimization_barrier(jnp.swapaxes(t, -1, -2))


def mhc_gate_logits(streams, fn, base, scale, *, n: int, hc_eps: float, norm_eps: float):
    """(pre [..., n], post [..., n], Sinkhorn logits [..., n, n]) of one mHC module, fp32
    (§2.3 steps 1-4)."""
    u = stream_logits(streams, fn, norm_eps)
    base = base.astype(jnp.float32)
    scale = scale.astype(jnp.float32)
    pre = jax.nn.sigmoid(scale[0] * u[..., :n] + base[:n]) + hc_eps
    post = 2.0 * jax.nn.sigmoid(scale[1] * u[..., n:2 * n] + base[n:2 * n])
    # The barrier keeps the affine map with the projection's reduction: fused into the
    # Sinkhorn's Triton kernel instead, it needs the layer's slice of the stacked base and
    # scale as kernels of their own (two per module inside a scanned layer group).
    comb_logits = jax.lax.optimization_barrier(scale[2] * u[..., 2 * n:] + base[2 * n:])
    return pre, post, comb_logits.reshape(*u.shape[:-1], n, n)


def mhc_weights(streams, fn, base, scale, *, n: int, iters: int, hc_eps: float, norm_eps: float):
    """(pre [..., n], post [..., n], comb [..., n, n]) of one mHC module, all fp32 (§2.3 1-5)."""
    pre, post, logits = mhc_gate_logits(streams, fn, base, scale, n=n, hc_eps=hc_eps,
                                        norm_eps=norm_eps)
    return pre, post, sinkhorn(logits, iters, hc_eps)


def collapse(streams: jax.Array, pre: jax.Array) -> jax.Array:
    """h = sum_j pre_j X_j in fp32, cast back to the stream dtype: [..., n, D] -> [..., D].

    Summed over j as explicit adds of per-stream terms (the gates as [...] slices, as in
    `expand`)."""
    x = streams.astype(jnp.float32)
    h = pre[..., 0, None] * x[..., 0, :]
    for j in range(1, streams.shape[-2]):
        h = h + pre[..., j, None] * x[..., j, :]
    return h.astype(streams.dtype)


# Token count up to which `expand` reads the gates as per-token slices (decode steps).
EXPAND_SLICES_MAX_TOKENS = 64


def expand(streams: jax.Array, y: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """X'_k = post_k y + sum_j P[j,k] X_j  (P^T X, not P X: §2.3 step 7, §4.13).

    The mix is fp32 products of operands rounded to the stream dtype (as a matmul in that
    dtype with fp32 accumulation), summed over j with explicit adds in stream order.

    Two equal forms (same operations, same order): up to EXPAND_SLICES_MAX_TOKENS tokens the
    gates are read as per-(j, k) [...] slices, so gates computed in another layout (the mHC
    kernels' token-minor gates^T) are read in place by one fused loop, where whole-array
    broadcasts made XLA:GPU transpose them in kernels of their own; above it, one broadcast
    over [..., j, k, D], which XLA:GPU fuses without fp32 copies of the streams."""
    dtype = streams.dtype
    lead, n = streams.shape[:-2], streams.shape[-2]
    fed = lambda a: a.astype(dtype).astype(jnp.float32)
    if math.prod(lead) <= EXPAND_SLICES_MAX_TOKENS:
        x = [fed(streams[..., j, :]) for j in range(n)]
        outs = []
        for k in range(n):
            mixed = fed(comb[..., 0, k])[..., None] * x[0]
            for j in range(1, n):
                mixed = mixed + fed(comb[..., j, k])[..., None] * x[j]
            outs.append(post[..., k].astype(dtype)[..., None] * y + mixed.astype(dtype))
        return jnp.stack(outs, axis=-2).astype(dtype)
    terms = fed(comb)[..., None] * fed(streams)[..., :, None, :]      # [..., j, k, D]
    mixed = terms[..., 0, :, :]
    for j in range(1, n):
        mixed = mixed + terms[..., j, :, :]
    out = post.astype(dtype)[..., None] * y[..., None, :] + mixed.astype(dtype)
    return out.astype(dtype)


def head_collapse(streams, fn, base, scale, *, hc_eps: float, norm_eps: float) -> jax.Array:
    """Final collapse: pre_j = sigmoid(scale * (fn . z)_j + base_j) + eps, no Sinkhorn (§2.3)."""
    u = stream_logits(streams, fn, norm_eps)
    pre = jax.nn.sigmoid(scale.astype(jnp.float32)[0] * u + base.astype(jnp.float32)) + hc_eps
    return collapse(streams, pre)
