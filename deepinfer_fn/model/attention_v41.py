"""DeepSeek-V4.1 attention of one layer over a whole sequence, with the cross-layer shared
buffers (docs/MODEL.md §V2.2-§V2.6).

Every layer owns wq_a/q_norm/wq_b/wkv/kv_norm/wo_a/wo_b/sinks and its window; no per-head
query norm (`q_head_norm=False`). Code-0 layers attend to the window and the sink with the main
RoPE. Code-1/2 layers use the compress RoPE for every rotated tensor and also attend to the
rows their code's selection picks. What a layer reads and writes depends on its roles (the
"+kv_source", "+index_source", "+candidate_publish" / "+candidate_consume" parts of its kind,
`ModelConfig.layer_kind`):

  shared = {"latents": {code: {"rows", "keys"}},      # written by kv sources (model.latents)
            "selected": {code: bool [B, T, N]},        # written by index sources
            "candidates": bool [B, T, NB]}             # written by the candidate source

`empty_shared` builds zero buffers with static shapes, so the same layer body runs unrolled
or inside a scan over repeated layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_fn import kernels
from deepinfer_fn.config import ModelConfig
from deepinfer_fn.model import latents as lat
from deepinfer_fn.model import selection
from deepinfer_fn.model.attention import (DECODE_CHUNK_MAX, chunk_query_prep, kv_projection,
                                         output_projection, window_bias, windowed)
from deepinfer_fn.model.common import head_rms, linear, rms_norm
from deepinfer_fn.model.rope import apply_rope, rope_cos_sin, rope_frequencies

NEG_INF = -jnp.inf


def roles_of(kind: str) -> tuple[str, frozenset[str]]:
    """(layer type, roles) of a V4.1 layer kind 'type+role+role'."""
    lt, *roles = kind.split("+")
    return lt, frozenset(roles)


def empty_shared(cfg: ModelConfig, batch: int, length: int, dtype,
                 capacity: int | None = None) -> dict:
    """Zero shared buffers for `length` query tokens (module docstring). Rows per code:
    length // code (a whole sequence), or max(capacity // code, 1) (a chunk against a decode
    state of `capacity` tokens, `state.V41DecodeState`)."""
    n_rows = (lambda c: length // c) if capacity is None else (lambda c: max(capacity // c, 1))
    latents = lat.empty_latents(cfg, batch, n_rows, dtype)
    out = {"latents": latents,
           "selected": {c: jnp.zeros((batch, length, n_rows(c)), bool) for c in latents}}
    src = cfg.candidate_source_layer_id
    if src >= 0:
        nb = -(-n_rows(cfg.compress_ratio(src)) // cfg.candidate_block_size)
        out["candidates"] = jnp.zeros((batch, length, nb), bool)
    return out


def query(p, x: jax.Array, cos, sin, cfg: ModelConfig, raw: bool = False):
    """q [B, T, H, d] (rotated; head-normed only if cfg.q_head_norm) and c_q [B, T, q_lora].
    raw: q before its head norm and rotation, for `kernels.chunk_attention` with
    `chunk_query_prep(..., head_norm=cfg.q_head_norm)`."""
    B, T, _ = x.shape
    eps = cfg.rms_norm_eps
    c_q = rms_norm(linear(x, p["wq_a"]), p["q_norm"], eps)
    q = linear(c_q, p["wq_b"]).reshape(B, T, cfg.num_attention_heads, cfg.head_dim)
    if raw:
        return q, c_q
    if cfg.q_head_norm:
        q = head_rms(q, eps)
    return apply_rope(q, cos[:, :, None], sin[:, :, None]), c_q


def select(p, c_q, x, positions, cos, sin, code: int, roles, shared: dict, cfg: ModelConfig):
    """An index source's selection (and the candidate source's published blocks): the new
    shared buffers. The scores use this layer's queries and its kv source's index keys."""
    keys = shared["latents"][code]["keys"]
    visible = lat.visible_rows(positions, keys.shape[1], code)
    s = selection.scores(p["indexer"], c_q, x, keys, cos, sin, cfg)
    k, block = cfg.index_topk, cfg.candidate_block_size
    shared = {**shared, "selected": dict(shared["selected"])}
    if "candidate_consume" in roles:
        chosen = selection.candidate_top_k(s, visible, shared["candidates"], block, k)
    else:
        chosen = selection.full_top_k(s, visible, k)
    if "candidate_publish" in roles:
        shared["candidates"] = selection.candidate_blocks(s, visible, block,
                                                          cfg.candidate_topk_blocks)
    shared["selected"][code] = chosen
    return shared


def attention_sequence(p, x: jax.Array, positions: jax.Array, kind: str, shared: dict,
                       cfg: ModelConfig):
    """One V4.1 layer's attention from position 0: x [B, T, D] (after attn_norm), positions
    [B, T] = arange(T) -> (out [B, T, D], new shared buffers)."""
    lt, roles = roles_of(kind)
    code = lat.layer_code(cfg, lt)
    freqs = rope_frequencies(cfg, lt)
    cos, sin = rope_cos_sin(positions, freqs, x.dtype)
    blocked = x.shape[1] > DECODE_CHUNK_MAX
    q, c_q = query(p, x, cos, sin, cfg, raw=blocked)
    kv = kv_projection(p, x, cos, sin, cfg)
    rows = chosen = None
    if code:
        if "kv_source" in roles:
            shared = {**shared, "latents": {**shared["latents"],
                                            code: lat.publish(p, x, code, cfg)}}
        if "index_source" in roles:
            shared = select(p, c_q, x, positions, cos, sin, code, roles, shared, cfg)
        rows = shared["latents"][code]["rows"].astype(kv.dtype)
        chosen = shared["selected"][code]
    if blocked:
        o = windowed(p, q, kv, rows, chosen, cfg,
                     **chunk_query_prep(cos, sin, cfg, head_norm=cfg.q_head_norm))
    else:
        keys, bias = kv, window_bias(positions, positions, cfg.sliding_window)
        if code:
            keys = jnp.concatenate([kv, rows], axis=1)
            bias = jnp.concatenate(
                [bias, jnp.where(chosen, 0.0, NEG_INF).astype(jnp.float32)], axis=-1)
        o = kernels.attention(q, keys, bias, p["sinks"])
    return output_projection(p, o, cos, sin, cfg), shared

