"""Manifold-constrained hyper-connections: n residual streams mixed per sub-block (spec §2.3).

`sublayer_pre` / `sublayer_post` are the two sides of a sub-block, each one registry op
(`kernels.mhc_pre`, `kernels.mhc_post`: one fused kernel each where a Mosaic GPU kernel
exists). The per-step functions (`mhc_weights`, `collapse`, `expand`, `head_collapse`) live in
deepinfer_fn.model.mhc_math and are re-exported here.
"""

from __future__ import annotations

import jax

from deepinfer_fn import kernels
from deepinfer_fn.config import ModelConfig
from deepinfer_fn.model.mhc_math import (collapse, expand, head_collapse, mhc_weights, sinkhorn,
                                         stream_logits)

__all__ = ["collapse", "expand", "head_collapse", "mhc_weights", "sinkhorn", "stream_logits",
           "sublayer_pre", "sublayer_post"]


def sublayer_pre(hc, norm, streams: jax.Array, cfg: ModelConfig):
    """mHC collapse + the sub-block's RMSNorm: streams [..., n, D] ->
    (h [..., D] in streams' dtype, post [..., n] fp32, comb [..., n, n] fp32).

    hc: the module's {"fn", "base", "scale"}; norm: the RMSNorm weight [D].
    """
    lead, (n, d) = streams.shape[:-2], streams.shape[-2:]
    if n != cfg.hc_mult or d != cfg.hidden_size:
        raise ValueError(f"sublayer_pre: streams {streams.shape} do not end in "
                         f"[hc_mult={cfg.hc_mult}, hidden_size={cfg.hidden_size}]")
    h, post, comb = kernels.mhc_pre(streams.reshape(-1, n, d), hc["fn"], hc["base"], hc["scale"],
                                    norm, iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
                                    norm_eps=cfg.rms_norm_eps)
    return h.reshape(*lead, d), post.reshape(*lead, n), comb.reshape(*lead, n, n)


def sublayer_post(streams: jax.Array, y: jax.Array, post: jax.Array,
                  comb: jax.Array) -> jax.Array:
    """mHC expand: streams [..., n, D], y [..., D], post [..., n], comb [..., n, n] ->
    new streams [..., n, D] (spec §2.3 step 7)."""
    lead, (n, d) = streams.shape[:-2], streams.shape[-2:]
    out = kernels.mhc_post(streams.reshape(-1, n, d), y.reshape(-1, d), post.reshape(-1, n),
                           comb.reshape(-1, n, n))
    return out.reshape(streams.shape)
