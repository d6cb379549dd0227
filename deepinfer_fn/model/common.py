"""Shared primitives: linear layers with the dtype policy, RMS norms (spec §2.2, §2.12)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_fn.kernel_registry import call, register


def matmul_precision(dtype):
    """float32 weights mean parity mode: force true fp32 matmuls (no TF32 on GPUs)."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT


def two_rows(x: jax.Array, axis: int = 0) -> jax.Array:
    """x with a zero entry appended on `axis` (size 1 -> 2).

    A dot whose activation side is a single row ([1, K] @ [K, N], K * N < 10M) is rewritten
    by XLA:GPU into a multiply and a column reduction, unfused: the multiply writes an fp32
    [K, N] copy of the weight that the reduction reads back (5x the weight's bytes in
    every projection of a batch-1 decode step). Two rows keep it a GEMM, which streams the
    weight once; the second row costs nothing and is sliced off."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, 1)
    return jnp.pad(x, pad)


@register("linear", "xla")
def linear_xla(x: jax.Array, w: jax.Array) -> jax.Array:
    """`kernels.linear` in XLA: x [M, K] @ w [K, N] (a single row as two, `two_rows`)."""
    x = x.astype(w.dtype)
    single = x.shape[0] == 1
    y = jnp.matmul(two_rows(x) if single else x, w, precision=matmul_precision(w.dtype),
                   preferred_element_type=jnp.float32)
    return (y[:1] if single else y).astype(w.dtype)


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x @ w` with w stored [in, out]: x [..., K] -> [..., N]; fp32 accumulation, result in
    the weight's dtype. The registry op `linear` (XLA, or a weight-streaming kernel for the
    few rows of a decode step)."""
    lead = x.shape[:-1]
    y = call("linear", x.reshape(-1, x.shape[-1]).astype(w.dtype), w)
    return y.reshape(*lead, w.shape[-1])


@register("linear_many", "xla")
def linear_many_xla(x: jax.Array, ws) -> tuple[jax.Array, ...]:
    """`kernels.linear_many` in XLA: one `linear` per weight."""
    return tuple(linear(x, w) for w in ws)


def linear_many(x: jax.Array, ws) -> tuple[jax.Array, ...]:
    """`linear(x, w)` for each weight of `ws` (all [K, N_j]): x [..., K] -> tuple of
    [..., N_j]. The registry op `linear_many`: separate projections, or one weight-streaming
    launch for all of them on the few rows of a decode step."""
    bad = [tuple(w.shape) for w in ws if w.ndim != 2 or w.shape[0] != x.shape[-1]]
    if bad:
        raise ValueError(f"linear_many: every weight must be [K={x.shape[-1]}, N] for input "
                         f"{tuple(x.shape)}; got {bad}")
    lead = x.shape[:-1]
    ys = call("linear_many", x.reshape(-1, x.shape[-1]), tuple(ws))
    return tuple(y.reshape(*lead, w.shape[-1]) for y, w in zip(ys, ws))


@register("grouped_linear", "xla")
def grouped_linear_xla(x: jax.Array, w: jax.Array) -> jax.Array:
    """`kernels.grouped_linear` in XLA: one einsum (a single row as two, `two_rows`)."""
    single = x.shape[0] == 1
    y = einsum("ngi,gir->ngr", two_rows(x) if single else x, w, out_dtype=w.dtype)
    return y[:1] if single else y


def grouped_linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """Per-group projections: x [M, G, I], w [G, I, R] -> [M, G, R], y[:, g] = x[:, g] @ w[g];
    fp32 accumulation, result in w's dtype. The registry op `grouped_linear`."""
    return call("grouped_linear", x, w)


def swiglu(gate, up, limit: float):
    """silu(min(gate, limit)) * clip(up, -limit, limit) in fp32, in gate's dtype (§2.9)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(gate.dtype)


def operand_dtype(dtype):
    """The dtype dot operands are fed in. XLA:CPU has no batched bf16 x bf16 -> f32 dot, so
    on CPU bf16 operands are widened to f32 first: the products of bf16 values are exact in
    f32 and accumulation is f32 anyway, so the result is the same as on an accelerator."""
    if dtype != jnp.float32 and jax.default_backend() == "cpu":
        return jnp.float32
    return dtype


def einsum(spec: str, *operands, out_dtype, dtype=None) -> jax.Array:
    """einsum with operands in `dtype` (default: the last operand's), fp32 accumulation."""
    dtype = dtype or operands[-1].dtype
    fed = operand_dtype(dtype)
    y = jnp.einsum(spec, *[o.astype(dtype).astype(fed) for o in operands],
                   precision=matmul_precision(dtype), preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


def rms(x: jax.Array, eps: float) -> jax.Array:
    """Unweighted RMS normalisation over the last axis, statistics in fp32 (§2.2)."""
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, out_dtype=None) -> jax.Array:
    """Weighted RMSNorm: fp32 statistics and multiply, cast once (§2.2, §2.12)."""
    out_dtype = out_dtype or x.dtype
    return (weight.astype(jnp.float32) * rms(x, eps)).astype(out_dtype)


def head_rms_factor(x: jax.Array, eps: float) -> jax.Array:
    """`head_rms`'s factor rsqrt(mean(x^2) + eps) over the last axis, in x's dtype: [..., 1]."""
    xf = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps).astype(x.dtype)


def head_rms(x: jax.Array, eps: float) -> jax.Array:
    """Per-head unweighted query norm: rsqrt in fp32, multiply in the activation dtype (§2.12)."""
    return x * head_rms_factor(x, eps)
