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


def sublayer(hc, norm, streams, fn: Callable, cfg: ModelConfig):
    """mHC collapse -> RMSNorm -> fn -> mHC expand. fn(h [B,T,D]) -> (y [B,T,D], aux)."""
    pre, post, comb = _mhc(hc, streams, cfg)
    h = rms_norm(collapse(streams, pre), norm, cfg.rms_norm_eps)
    y, aux = fn(h)
    return expand(streams, y, post, comb), aux


def block(lp, streams, token_ids, positions, layer_type: str, mlp_type: str, cfg: ModelConfig,
          attention: Callable = attention_sequence):
    """One layer over a whole sequence: attention sub-layer then MoE sub-layer (§2.0).

    streams [B,T,n,D]; token_ids/positions [B,T]. Returns the new streams.
    """
    streams, _ = sublayer(lp["hc_attn"], lp["attn_norm"], streams,
                          lambda h: (attention(lp["attn"], h, positions, layer_type, cfg), None), cfg)
    streams, _ = sublayer(lp["hc_ffn"], lp["ffn_norm"], streams,
                          lambda h: (moe_layer(lp["ffn"], h, token_ids, mlp_type, cfg), None), cfg)
    return streams


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


def forward_chunk(params, state, token_ids, n_new, *, all_logits: bool = False, row_floor=None,
                  taps: tuple[int, ...] | None = None, tap: str = "post"):
    """Processes a chunk against a decode state (prefill chunk, decode step, or k-token verify).

    token_ids [B,S] int32 (entries past n_new[b] are padding); n_new [B] int32 in [0, S].
    Returns (logits, new_state, streams): logits float32 [B,S,V] if all_logits, else the
    logits of each row's last valid token [B,V] (rows with n_new = 0: garbage, state
    unchanged); streams [B,S,n,D] the final residual streams (MTP input).
    row_floor [B] int32 (optional): compressed rows of windows starting below this position
    are not rewritten (prefix-cache replay keeps the shared exact rows, spec/model.md §7).

    taps (layer ids, DSpark target features, spec/dspark.md §1.2): also return a 4th output,
    features [B,S,len(taps),D], each the residual streams averaged over the n mHC copies,
    read at the input ("pre") or the output ("post") of the tapped layer.
    """
    from deepinfer_fn.model.cached import attention_chunk
    from deepinfer_fn.state import DecodeState

    cfg = params.config
    B, S = token_ids.shape
    token_ids = jnp.clip(token_ids, 0, cfg.vocab_size - 1)
    start = state.lengths
    streams = embed(params, token_ids)
    new_layers = []
    tapped = {}
    if taps is not None:
        if tap not in ("pre", "post"):
            raise ValueError(f"tap must be 'pre' or 'post', got {tap!r}")
        bad = [i for i in taps if not 0 <= i < cfg.num_hidden_layers]
        if bad:
            raise ValueError(f"tap layer ids {bad} outside [0, {cfg.num_hidden_layers})")
    for i, (lp, ls, lt, mt) in enumerate(zip(params["layers"], state.layers, cfg.layer_types,
                                             cfg.mlp_layer_types)):
        if taps is not None and tap == "pre" and i in taps:
            tapped[i] = streams.mean(axis=2)
        streams, new_ls = sublayer(
            lp["hc_attn"], lp["attn_norm"], streams,
            lambda h: attention_chunk(lp["attn"], h, ls, start, n_new, lt, cfg, row_floor), cfg)
        streams, _ = sublayer(lp["hc_ffn"], lp["ffn_norm"], streams,
                              lambda h: (moe_layer(lp["ffn"], h, token_ids, mt, cfg), None), cfg)
        if taps is not None and tap == "post" and i in taps:
            tapped[i] = streams.mean(axis=2)
        new_layers.append(new_ls)
    new_state = DecodeState(tuple(new_layers), start + n_new, state.max_len, state.window_slots)
    head = lambda s: head_logits(params["hc_head"], params["norm"], params["head"], s, cfg)
    extra = () if taps is None else (jnp.stack([tapped[i] for i in taps], axis=2),)
    if all_logits:
        return (head(streams), new_state, streams) + extra
    last = jnp.clip(n_new - 1, 0, S - 1)
    last_streams = jnp.take_along_axis(streams, last[:, None, None, None], axis=1)
    return (head(last_streams)[:, 0], new_state, streams) + extra


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
