"""The V4 backbone: embedding into mHC streams, the block stack, the head (spec §2.0-§2.11)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from deepinfer_fn.config import SWA, SCORE_MOE, ModelConfig
from deepinfer_fn.model.attention import attention_sequence
from deepinfer_fn.model.common import linear, rms_norm
from deepinfer_fn.model.mhc import collapse, expand, head_collapse, mhc_weights
from deepinfer_fn.model.moe import moe_layer


def _mhc(p, streams, cfg: ModelConfig):
    return mhc_weights(streams, p["fn"], p["base"], p["scale"], n=cfg.hc_mult,
                       iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)


def block(lp, streams, token_ids, positions, layer_type: str, mlp_type: str, cfg: ModelConfig,
          attention: Callable = attention_sequence):
    """One layer: mHC collapse -> attention -> expand; mHC collapse -> MoE -> expand.

    streams [B,T,n,D]; token_ids/positions [B,T]. `attention(p, x, positions, type, cfg)`
    is the attention variant (whole sequence here; cached variants plug in the same way).
    """
    eps = cfg.rms_norm_eps
    pre, post, comb = _mhc(lp["hc_attn"], streams, cfg)
    h = rms_norm(collapse(streams, pre), lp["attn_norm"], eps)
    streams = expand(streams, attention(lp["attn"], h, positions, layer_type, cfg), post, comb)
    pre, post, comb = _mhc(lp["hc_ffn"], streams, cfg)
    h = rms_norm(collapse(streams, pre), lp["ffn_norm"], eps)
    return expand(streams, moe_layer(lp["ffn"], h, token_ids, mlp_type, cfg), post, comb)


def embed(params, token_ids):
    """Embedding rows broadcast to the n mHC streams: [B,T] -> [B,T,n,D] (§2.1)."""
    e = params["embed"][token_ids]
    return jnp.broadcast_to(e[:, :, None, :], (*e.shape[:2], params.config.hc_mult, e.shape[-1]))


def backbone(params, token_ids, positions):
    """Final residual streams [B,T,n,D] of the whole stack (before the head collapse)."""
    cfg = params.config
    streams = embed(params, token_ids)
    for lp, lt, mt in zip(params["layers"], cfg.layer_types, cfg.mlp_layer_types):
        streams = block(lp, streams, token_ids, positions, lt, mt, cfg)
    return streams


def head_logits(hc_head, norm, head, streams, cfg: ModelConfig):
    """Head collapse, final norm, untied head: streams [B,T,n,D] -> float32 logits [B,T,V]."""
    h = head_collapse(streams, hc_head["fn"], hc_head["base"], hc_head["scale"],
                      hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
    h = rms_norm(h, norm, cfg.rms_norm_eps)
    return jnp.matmul(h.astype(head.dtype), head, preferred_element_type=jnp.float32,
                      precision=jax.lax.Precision.HIGHEST if head.dtype == jnp.float32 else None)


def logits_and_streams(params, token_ids):
    B, T = token_ids.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    streams = backbone(params, token_ids, positions)
    return head_logits(params["hc_head"], params["norm"], params["head"], streams,
                       params.config), streams


def mtp_block(params, streams, next_token_ids, positions, depth: int = 0):
    """MTP block `depth` (§2.11): streams of the backbone at positions i plus the token at i+1
    -> logits for token i+2 [B,T,V] and the MTP block's own output streams [B,T,n,D].

    streams [B,T,n,D] are the backbone's final streams (before the head collapse);
    `next_token_ids` [B,T] the ids at positions i+1; positions [B,T] are i. The block's
    attention is a sliding window over the T positions given (its own window, from i = 0).
    """
    cfg = params.config
    if depth >= len(params["mtp"]):
        raise ValueError(f"these params have {len(params['mtp'])} MTP blocks; asked for #{depth}")
    mp = params["mtp"][depth]
    eps = cfg.rms_norm_eps
    e = rms_norm(params["embed"][next_token_ids], mp["enorm"], eps)
    x = linear(e, mp["e_proj"])[:, :, None, :] + linear(rms_norm(streams, mp["hnorm"], eps),
                                                        mp["h_proj"])
    x = block(mp["block"], x, next_token_ids, positions, SWA, SCORE_MOE, cfg)
    return head_logits(mp["hc_head"], mp["norm"], params["head"], x, cfg), x
