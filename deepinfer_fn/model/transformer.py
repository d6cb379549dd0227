"""The V4 backbone: embedding into mHC streams, the block stack, the head (spec §2.0-§2.11)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from deepinfer_fn.config import SWA, SCORE_MOE, ModelConfig
from deepinfer_fn.layer_groups import LayerStack, as_stack, layer_groups
from deepinfer_fn.model.attention import attention_sequence
from deepinfer_fn.model.cached import attention_chunk
from deepinfer_fn.model.common import linear, rms_norm
from deepinfer_fn.model.mhc import head_collapse, sublayer_post, sublayer_pre
from deepinfer_fn.model.moe import moe_layer
from deepinfer_fn.model import transformer_v41
from deepinfer_fn.state import DecodeState


def sublayer(hc, norm, streams, fn: Callable, cfg: ModelConfig):
    """mHC collapse -> RMSNorm -> fn -> mHC expand, one registry op per side
    (`kernels.mhc_pre` / `kernels.mhc_post`). fn(h [B,T,D]) -> (y [B,T,D], aux)."""
    h, post, comb = sublayer_pre(hc, norm, streams, cfg)
    y, aux = fn(h)
    return sublayer_post(streams, y, post, comb), aux


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
    """Final residual streams [B,T,n,D] of the whole stack (before the head collapse).

    Scanned layer groups (`layer_groups.py`) run as one `lax.scan` over their repeats.
    V4.1 configs run `transformer_v41.backbone` (positions must be arange(T))."""
    cfg = params.config
    if cfg.is_v41:
        return transformer_v41.backbone(params, token_ids)[0]
    layers = as_stack(layer_groups(cfg), params["layers"])
    streams = embed(params, token_ids)
    for g, blk in zip(layers.groups, layers.blocks):
        if not g.scanned:
            (lt, mt), = g.kinds
            streams = block(blk[0], streams, token_ids, positions, lt, mt, cfg)
            continue

        def body(streams, lps, g=g):
            for lp, (lt, mt) in zip(lps, g.kinds):
                streams = block(lp, streams, token_ids, positions, lt, mt, cfg)
            return streams, None

        streams, _ = jax.lax.scan(body, streams, blk)
    return streams


def head_logits(hc_head, norm, head, streams, cfg: ModelConfig):
    """Head collapse, final norm, untied head: streams [B,T,n,D] -> float32 logits [B,T,V]."""
    h = head_collapse(streams, hc_head["fn"], hc_head["base"], hc_head["scale"],
                      hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
    h = rms_norm(h, norm, cfg.rms_norm_eps)
    return jnp.matmul(h.astype(head.dtype), head, preferred_element_type=jnp.float32,
                      precision=jax.lax.Precision.HIGHEST if head.dtype == jnp.float32 else None)


def _layer_chunk(lp, ls, layer, streams, token_ids, start, n_new, lt: str, mt: str,
                 cfg: ModelConfig, row_floor):
    """One layer of `forward_chunk`: (streams, new layer state). ls: the layer's state dict, or
    its group's stacked dict with `layer` its index there (written in place, model/cached.py)."""
    streams, new_ls = sublayer(
        lp["hc_attn"], lp["attn_norm"], streams,
        lambda h: attention_chunk(lp["attn"], h, ls, start, n_new, lt, cfg, row_floor, layer),
        cfg)
    streams, _ = sublayer(lp["hc_ffn"], lp["ffn_norm"], streams,
                          lambda h: (moe_layer(lp["ffn"], h, token_ids, mt, cfg), None), cfg)
    return streams, new_ls


def forward_chunk(params, state, token_ids, n_new, *, all_logits: bool = False, row_floor=None,
                  taps: tuple[int, ...] | None = None, tap: str = "post"):
    """Processes a chunk against a decode state (prefill chunk, decode step, or k-token verify).

    token_ids [B,S] int32 (entries past n_new[b] are padding); n_new [B] int32 in [0, S].
    Returns (logits, new_state, streams): logits float32 [B,S,V] if all_logits, else the
    logits of each row's last valid token [B,V] (rows with n_new = 0: garbage, state
    unchanged); streams [B,S,n,D] the final residual streams (MTP input).
    row_floor [B] int32 (optional): compressed rows of windows starting below this position
    are not rewritten (prefix-cache replay keeps the shared exact rows, docs/MODEL.md §7).

    V4.1 configs run `transformer_v41.forward_chunk` (state: `state.V41DecodeState`).

    taps (layer ids, DSpark target features, docs/MODEL.md §D1.2): also return a 4th output,
    features [B,S,len(taps),D], each the residual streams averaged over the n mHC copies,
    read at the input ("pre") or the output ("post") of the tapped layer.

    Scanned layer groups run as one `lax.scan` over their repeats with the group's stacked
    state in the carry, updated in place by the repeat index; taps inside a scanned group are
    scan outputs. The new state has the params' grouping (a tuple state is restacked).
    """
    cfg = params.config
    if cfg.is_v41:
        return transformer_v41.forward_chunk(params, state, token_ids, n_new,
                                             all_logits=all_logits, row_floor=row_floor,
                                             taps=taps, tap=tap)
    B, S = token_ids.shape
    token_ids = jnp.clip(token_ids, 0, cfg.vocab_size - 1)
    start = state.lengths
    groups = layer_groups(cfg)
    players = as_stack(groups, params["layers"])
    slayers = as_stack(groups, state.layers)
    streams = embed(params, token_ids)
    tapped = {}
    if taps is not None:
        if tap not in ("pre", "post"):
            raise ValueError(f"tap must be 'pre' or 'post', got {tap!r}")
        bad = [i for i in taps if not 0 <= i < cfg.num_hidden_layers]
        if bad:
            raise ValueError(f"tap layer ids {bad} outside [0, {cfg.num_hidden_layers})")
    tap_set = set(taps or ())
    feature = lambda x: x.mean(axis=2)
    args = (token_ids, start, n_new)
    new_blocks = []
    for g, pblk, sblk in zip(groups, players.blocks, slayers.blocks):
        if not g.scanned:
            (lt, mt), = g.kinds
            if tap == "pre" and g.start in tap_set:
                tapped[g.start] = feature(streams)
            streams, new_ls = _layer_chunk(pblk[0], sblk[0], None, streams, *args, lt, mt, cfg,
                                           row_floor)
            if tap == "post" and g.start in tap_set:
                tapped[g.start] = feature(streams)
            new_blocks.append((new_ls,))
            continue
        # unit positions j with a tapped layer in this group: emit their features per repeat
        tap_pos = sorted({g.locate(i)[1] for i in tap_set if g.start <= i < g.stop})

        def body(carry, xs, g=g, tap_pos=tap_pos):
            streams, sts = carry
            lps, r = xs
            sts, feats = list(sts), {}
            for j, (lt, mt) in enumerate(g.kinds):
                if tap == "pre" and j in tap_pos:
                    feats[j] = feature(streams)
                streams, sts[j] = _layer_chunk(lps[j], sts[j], r, streams, *args, lt, mt, cfg,
                                               row_floor)
                if tap == "post" and j in tap_pos:
                    feats[j] = feature(streams)
            return (streams, tuple(sts)), tuple(feats[j] for j in tap_pos)

        (streams, new_sts), ys = jax.lax.scan(
            body, (streams, tuple(sblk)), (pblk, jnp.arange(g.repeats, dtype=jnp.int32)))
        for i in tap_set:
            if g.start <= i < g.stop:
                r, j = g.locate(i)
                tapped[i] = ys[tap_pos.index(j)][r]
        new_blocks.append(new_sts)
    new_state = DecodeState(LayerStack(groups, tuple(new_blocks)), start + n_new, state.max_len,
                            state.window_slots)
    head = lambda s: head_logits(params["hc_head"], params["norm"], params["head"], s, cfg)
    extra = () if taps is None else (jnp.stack([tapped[i] for i in taps], axis=2),)
    if all_logits:
        return (head(streams), new_state, streams) + extra
    last = jnp.clip(n_new - 1, 0, S - 1)
    last_streams = jnp.take_along_axis(streams, last[:, None, None, None], axis=1)
    return (head(last_streams)[:, 0], new_state, streams) + extra


def logits_and_streams(params, token_ids):
    """(float32 logits [B,T,V], final streams [B,T,n,D]) of a whole sequence, no cache.
    V4.1 configs run `transformer_v41.logits_and_streams`."""
    if params.config.is_v41:
        return transformer_v41.logits_and_streams(params, token_ids)
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
    if cfg.is_v41:
        raise NotImplementedError("mtp_block: V4.1 checkpoints carry a DSpark drafter, not MTP "
                                  "blocks")
    if depth >= len(params["mtp"]):
        raise ValueError(f"these params have {len(params['mtp'])} MTP blocks; asked for #{depth}")
    mp = params["mtp"][depth]
    eps = cfg.rms_norm_eps
    e = rms_norm(params["embed"][next_token_ids], mp["enorm"], eps)
    x = linear(e, mp["e_proj"])[:, :, None, :] + linear(rms_norm(streams, mp["hnorm"], eps),
                                                        mp["h_proj"])
    x = block(mp["block"], x, next_token_ids, positions, SWA, SCORE_MOE, cfg)
    return head_logits(mp["hc_head"], mp["norm"], params["head"], x, cfg), x
