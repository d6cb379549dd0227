"""Partial, interleaved, trailing rotary embedding with the V4 YaRN table (spec §2.4)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_fn.config import SWA, ModelConfig


def rope_frequencies(cfg: ModelConfig, layer_type: str) -> np.ndarray:
    """Per-pair angular frequencies f_i, i < r_d/2: 'main' table on SWA layers, YaRN 'compress'
    table on CSA/HCA layers (§2.4). float64 numpy, cast by the caller."""
    r = cfg.qk_rope_head_dim
    i = np.arange(r // 2, dtype=np.float64)
    if layer_type == SWA:
        return cfg.rope_theta ** (-2.0 * i / r)
    base = cfg.compress_rope_theta
    f_base = base ** (-2.0 * i / r)
    if cfg.yarn_factor == 1.0:
        return f_base

    def c(beta):
        return r * math.log(cfg.yarn_original_max_position / (2 * math.pi * beta)) / (2 * math.log(base))

    lo = max(math.floor(c(cfg.yarn_beta_fast)), 0)
    hi = min(math.ceil(c(cfg.yarn_beta_slow)), r - 1)
    if lo == hi:
        hi = hi + 0.001
    ramp = np.clip((i - lo) / (hi - lo), 0.0, 1.0)
    return f_base * (1.0 - ramp) + (f_base / cfg.yarn_factor) * ramp


def rope_cos_sin(positions: jax.Array, freqs: np.ndarray, dtype=jnp.float32):
    """cos/sin of t * f_i in fp32, rounded to the activation dtype (§2.12): [..., r_d/2]."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(freqs, jnp.float32)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, inverse: bool = False) -> jax.Array:
    """Rotates the last 2*len(cos) channels of `x` as interleaved pairs (2i, 2i+1).

    x: [..., d]; cos/sin broadcast against x[..., :r/2] (callers add a heads axis:
    `cos[:, :, None]` for x [B, T, H, d]). `inverse` applies the angle -theta (§2.8).
    """
    r = 2 * cos.shape[-1]
    cos, sin = cos.astype(jnp.float32), sin.astype(jnp.float32)
    if inverse:
        sin = -sin
    keep, rot = x[..., :-r], x[..., -r:].astype(jnp.float32)
    a, b = rot[..., 0::2], rot[..., 1::2]
    rotated = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(rot.shape)
    return jnp.concatenate([keep, rotated.astype(x.dtype)], axis=-1)


def apply_rope_in_place(x: jax.Array, cos: jax.Array, sin: jax.Array,
                        inverse: bool = False) -> jax.Array:
    """`apply_rope` (the same values: each lane's two products, the same sum) as an update of
    x's last r channels only, written as lane-wise products with the pair-swapped channels:
    XLA:GPU writes the r channels into x's buffer (a copy of them, then an in-place update)
    instead of rewriting all d (large activations)."""
    r = 2 * cos.shape[-1]
    tail = x[..., -r:].astype(jnp.float32)
    c = jnp.repeat(cos.astype(jnp.float32), 2, axis=-1)
    s = jnp.repeat(sin.astype(jnp.float32), 2, axis=-1)
    even = np.arange(r) % 2 == 0            # lane 2i: a cos - b sin; lane 2i+1: b cos + a sin
    signed = jnp.where(even, s if inverse else -s, -s if inverse else s)
    swapped = tail.reshape(*tail.shape[:-1], r // 2, 2)[..., ::-1].reshape(tail.shape)
    rotated = (tail * c + swapped * signed).astype(x.dtype)
    return jax.lax.dynamic_update_slice_in_dim(x, rotated, x.shape[-1] - r, axis=x.ndim - 1)
