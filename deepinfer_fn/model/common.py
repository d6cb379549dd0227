"""Shared primitives: linear layers with the dtype policy, RMS norms (spec §2.2, §2.12)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def matmul_precision(dtype):
    """float32 weights mean parity mode: force true fp32 matmuls (no TF32 on GPUs)."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x @ w` with w stored [in, out]; fp32 accumulation, result in the weight's dtype."""
    y = jnp.matmul(x.astype(w.dtype), w, precision=matmul_precision(w.dtype),
                   preferred_element_type=jnp.float32)
    return y.astype(w.dtype)


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


def head_rms(x: jax.Array, eps: float) -> jax.Array:
    """Per-head unweighted query norm: rsqrt in fp32, multiply in the activation dtype (§2.12)."""
    xf = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return x * inv.astype(x.dtype)
