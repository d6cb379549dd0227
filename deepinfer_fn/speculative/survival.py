"""Prefix survivals of a speculative step's drafts (docs/MODEL.md §D1.5).

c_{r,j} = sigmoid(z_{r,j} / t_j) (z: the confidence head's logits, t: STS temperatures) and
a_{r,j} = prod_{i<=j} c_{r,i} = P(first j drafts of row r all accepted)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def survivals(conf_logits, temps):
    """a [B,g] f32: a_{r,j} = prod_{i<=j} sigmoid(z_{r,i} / t_i) (§1.5). conf_logits [B,g],
    temps [g] (> 0)."""
    z = jnp.asarray(conf_logits, jnp.float32)
    t = jnp.asarray(temps, jnp.float32)
    return jnp.cumprod(jax.nn.sigmoid(z / t), axis=-1)


def survivals_np(conf_logits, temps) -> np.ndarray:
    """`survivals` in float64 numpy (host-side schedulers and calibration)."""
    z = np.asarray(conf_logits, np.float64)
    t = np.asarray(temps, np.float64)
    return np.cumprod(sigmoid_np(z / t), axis=-1)


def sigmoid_np(x):
    """The logistic function in numpy (tanh form: no overflow)."""
    return 0.5 * (1.0 + np.tanh(0.5 * x))

