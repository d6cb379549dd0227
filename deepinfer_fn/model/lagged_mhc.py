"""mHC with a lagged collapse, DeepSeek-V4.1 (docs/MODEL.md §V2.1).

A sublayer with parameters (fn, base, scale), block norm N and function F, given the residual
R [..., n, D] and the pending weights p [..., n] of the previous sublayer:

    x = N(sum_j p_j R_j);  y = F(x);  (pre, post, comb) = mHC statistics of R;
    R' = post * y + comb^T R;  hand p <- pre to the next sublayer.

`pre` is never applied to the residual it was computed from. The first sublayer of the model
has no p: it collapses stream 0 (all streams are equal there), which is p = e_0
(`initial_pending`). The head collapses with the last p (no hc_head). The V4 form ("collapse
with own pre", `fused_sublayer`) is kept as the negative control of the tests and ablations.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from deepinfer_fn.config import ModelConfig
from deepinfer_fn.model.common import rms_norm
from deepinfer_fn.model.mhc import sublayer_post
from deepinfer_fn import kernels
from deepinfer_fn.model.mhc_math import collapse, mhc_gate_logits


def initial_pending(lead: tuple[int, ...], n: int) -> jax.Array:
    """p = e_0 (collapse to stream 0) for the model's first sublayer: fp32 [*lead, n]."""
    return jnp.broadcast_to(jnp.eye(n, dtype=jnp.float32)[0], (*lead, n))


def statistics(hc, streams: jax.Array, cfg: ModelConfig):
    """(pre [..., n], post [..., n], comb [..., n, n]) fp32 of one mHC module on streams
    [..., n, D]; the flattened-RMS eps is rms_norm_eps (1e-20 for V4.1)."""
    pre, post, logits = mhc_gate_logits(streams, hc["fn"], hc["base"], hc["scale"],
                                        n=cfg.hc_mult, hc_eps=cfg.hc_eps,
                                        norm_eps=cfg.rms_norm_eps)
    n = cfg.hc_mult
    comb = kernels.sinkhorn(logits.reshape(-1, n, n), iters=cfg.hc_sinkhorn_iters,
                            eps=cfg.hc_eps)
    return pre, post, comb.reshape(logits.shape)


def _check(streams, pending, cfg: ModelConfig):
    n, d = streams.shape[-2:]
    if n != cfg.hc_mult or d != cfg.hidden_size:
        raise ValueError(f"lagged mHC: streams {streams.shape} do not end in "
                         f"[hc_mult={cfg.hc_mult}, hidden_size={cfg.hidden_size}]")
    if pending.shape != streams.shape[:-1]:
        raise ValueError(f"lagged mHC: pending {pending.shape} must be {streams.shape[:-1]}")


def lagged_sublayer(hc, norm, streams: jax.Array, pending: jax.Array, fn: Callable,
                    cfg: ModelConfig):
    """One V4.1 sublayer: streams [..., n, D], pending fp32 [..., n] -> (new streams, new
    pending = this module's pre, fn's aux). fn(x [..., D]) -> (y [..., D], aux)."""
    _check(streams, pending, cfg)
    x = rms_norm(collapse(streams, pending), norm, cfg.rms_norm_eps)
    y, aux = fn(x)
    pre, post, comb = statistics(hc, streams, cfg)
    return sublayer_post(streams, y, post, comb), pre, aux


def fused_sublayer(hc, norm, streams: jax.Array, pending: jax.Array, fn: Callable,
                   cfg: ModelConfig):
    """V4's form with the same signature: collapse with this module's own pre (`pending`
    ignored, handed on as the own pre). Not V4.1: the negative control of the lag."""
    _check(streams, pending, cfg)
    pre, post, comb = statistics(hc, streams, cfg)
    x = rms_norm(collapse(streams, pre), norm, cfg.rms_norm_eps)
    y, aux = fn(x)
    return sublayer_post(streams, y, post, comb), pre, aux


def final_collapse(streams: jax.Array, pending: jax.Array) -> jax.Array:
    """h = sum_j p_j X_j with the last FFN's pre: [..., n, D], [..., n] -> [..., D] (§2.9)."""
    assert pending.shape == streams.shape[:-1], (pending.shape, streams.shape)
    return collapse(streams, pending)
