"""DeepSeek-V4.1 attention of a chunk of new tokens against a layer's decode state
(docs/MODEL.md §V3; `state.V41DecodeState`).

Token update order per layer: q, window KV; at a kv source the new latents and index keys are
written into the state (code 1: row t per token; code 2: row j when token 2j+1 arrives, its
partner from the chunk or the state's pending token); at an index source the selection (and at
the candidate source the published blocks) over the source's rows; then one softmax over the
window (ring entries before the chunk + the chunk's own keys), the selected rows and the sink.
A row emitted at t is visible at t. Everything is addressed by absolute position, so the
shared buffers are the source layers' state arrays (`model.attention_v41` for their layout).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_fn import kernels
from deepinfer_fn.config import ModelConfig
from deepinfer_fn.model import latents as lat
from deepinfer_fn.model.attention import (DECODE_CHUNK_MAX, chunk_query_prep, kv_projection,
                                         output_projection)
from deepinfer_fn.model.attention_v41 import query, roles_of, select
from deepinfer_fn.model.cached import DENSE_ROWS_MAX
from deepinfer_fn.model.common import rms_norm
from deepinfer_fn.model.rope import rope_cos_sin, rope_frequencies
from deepinfer_fn.model.selection import selected_rows

NEG_INF = -jnp.inf


def chunk_positions(start: jax.Array, n_new: jax.Array, S: int):
    """positions [B, S] = start + i and valid [B, S] = i < n_new."""
    i = jnp.arange(S, dtype=jnp.int32)[None]
    return start[:, None] + i, i < n_new[:, None]


def _scatter_rows(buf: jax.Array, idx: jax.Array, values: jax.Array, write: jax.Array):
    """buf [B, R, ...] with values [B, S, ...] written at idx [B, S] where `write`."""
    B, R = buf.shape[:2]
    idx = jnp.where(write, idx, R)                        # out of range: dropped
    b = jnp.broadcast_to(jnp.arange(B)[:, None], idx.shape)
    return buf.at[b, idx].set(values.astype(buf.dtype), mode="drop")


def ring_write(buf: jax.Array, pos: jax.Array, values: jax.Array, valid: jax.Array):
    """A ring buf [B, R, ...] with values [B, S, ...] of the valid chunk tokens written at slot
    position % R (only the last R of them, so no slot is written twice)."""
    slots = buf.shape[1]
    end = jnp.max(jnp.where(valid, pos + 1, 0), axis=1)
    return _scatter_rows(buf, pos % slots, values, valid & (pos >= end[:, None] - slots))


def ring_read(buf: jax.Array, pos: jax.Array) -> jax.Array:
    """Entries of a ring buf [B, R, ...] at positions pos [B, K] -> [B, K, ...]."""
    idx = (pos % buf.shape[1]).reshape(pos.shape + (1,) * (buf.ndim - 2))
    return jnp.take_along_axis(buf, idx, axis=1)


def window(ls: dict, kv_new: jax.Array, pos: jax.Array, valid: jax.Array, start: jax.Array,
           cfg: ModelConfig, floor=None):
    """(keys [B, W_slots + S, d], ok bool [B, S, W_slots + S], new ring): ring entries of
    positions before the chunk plus the chunk's own keys, within the window of each query.
    floor [B] (optional): keys below this position are not read (decoder bounded replay)."""
    W = cfg.sliding_window
    t = pos[:, :, None]
    lo = t - W if floor is None else jnp.maximum(t - W, floor[:, None, None] - 1)
    rp = ls["window_pos"][:, None, :]
    ok_ring = (rp >= 0) & (rp < start[:, None, None]) & (rp <= t) & (rp > lo)
    cp = pos[:, None, :]
    ok_chunk = valid[:, None, :] & (cp <= t) & (cp > lo)
    keys = jnp.concatenate([ls["window_kv"], kv_new.astype(ls["window_kv"].dtype)], axis=1)
    ok = jnp.concatenate([ok_ring, ok_chunk], axis=-1)
    ring = {"window_kv": ring_write(ls["window_kv"], pos, kv_new, valid),
            "window_pos": ring_write(ls["window_pos"], pos, pos, valid)}
    return keys, ok, ring


def source_update(p, ls: dict, x: jax.Array, pos: jax.Array, valid: jax.Array, code: int,
                  cfg: ModelConfig, row_floor=None) -> dict:
    """A kv source's new state entries after the chunk x [B, S, D] (attention input):
    rows / keys (and for code 2 the raw kappa / gate ring; a pair closing at the chunk's
    first token takes its partner, position start - 1, from there). row_floor [B]
    (optional): rows at positions below it are not written (the state's are kept); the
    kappa / gate ring is written regardless."""
    eps = cfg.rms_norm_eps
    cp = p["compressor"]
    new = {}
    if code == 1:
        L, row_idx, emit = lat.source_latents(cp, x, 1, eps), pos, valid
    else:
        kappa, gate = lat.pair_inputs(cp, x)
        before = pos[:, :1] - 1
        prev_k = jnp.concatenate([ring_read(ls["pend_kv"], before).astype(kappa.dtype),
                                  kappa[:, :-1]], 1)
        prev_g = jnp.concatenate([ring_read(ls["pend_gate"], before), gate[:, :-1]], 1)
        pooled = lat.pair_pool(jnp.stack([prev_k, kappa], axis=-2),
                               jnp.stack([prev_g, gate], axis=-2))
        L = rms_norm(pooled, cp["norm"], eps)
        row_idx, emit = pos // 2, valid & (pos % 2 == 1)
        new["pend_kv"] = ring_write(ls["pend_kv"], pos, kappa, valid)
        new["pend_gate"] = ring_write(ls["pend_gate"], pos, gate, valid)
    freqs = lat.compress_freqs(cfg)
    row_pos = code * row_idx
    if row_floor is not None:
        emit &= row_pos >= row_floor[:, None]
    new["rows"] = _scatter_rows(ls["rows"], row_idx, lat.rotate(L, row_pos, freqs), emit)
    new["keys"] = _scatter_rows(ls["keys"], row_idx,
                                lat.index_keys(p["indexer"], L, row_pos, freqs, eps), emit)
    return new


def attention_chunk(p, x: jax.Array, ls: dict, start: jax.Array, n_new: jax.Array,
                    kind: str, shared: dict, cfg: ModelConfig, row_floor=None,
                    window_floor=None):
    """One V4.1 layer over a chunk: x [B, S, D] (after attn_norm) at positions start + i,
    entries i >= n_new padding. Returns (out [B, S, D], new layer state, new shared).
    row_floor [B] (optional, token positions): a kv source writes no row below it (prefix
    replay keeps the shared rows); window_floor [B] (optional): window keys below it are
    not read (decoder SWA bounded replay, `model.replay_v41`)."""
    B, S, _ = x.shape
    lt, roles = roles_of(kind)
    code = lat.layer_code(cfg, lt)
    pos, valid = chunk_positions(start, n_new, S)
    cos, sin = rope_cos_sin(pos, rope_frequencies(cfg, lt), x.dtype)
    blocked = S > DECODE_CHUNK_MAX     # prefill chunks: chunk_attention rotates the query
    q, c_q = query(p, x, cos, sin, cfg, raw=blocked)
    kv = kv_projection(p, x, cos, sin, cfg)
    keys, ok, new_ls = window(ls, kv, pos, valid, start, cfg, window_floor)
    if code:
        if "kv_source" in roles:
            src = source_update(p, ls, x, pos, valid, code, cfg, row_floor)
            new_ls.update(src)
            shared = {**shared, "latents": {**shared["latents"],
                                            code: {"rows": src["rows"], "keys": src["keys"]}}}
        if "index_source" in roles:
            shared = select(p, c_q, x, pos, cos, sin, code, roles, shared, cfg)
    bias = jnp.where(ok, 0.0, NEG_INF).astype(jnp.float32)
    rows = shared["latents"][code]["rows"].astype(keys.dtype) if code else None
    if blocked:
        # Prefill chunk: the window blocked (`kernels.chunk_attention`); the selected rows
        # as a mask over every row while the buffer is small, else gathered per token.
        extra = {}
        if code and rows.shape[1] <= DENSE_ROWS_MAX:
            extra = dict(extra_keys=rows,
                         extra_bias=jnp.where(shared["selected"][code], 0.0, NEG_INF))
        elif code:
            row_idx = selected_rows(shared["selected"][code], cfg.index_topk)
            extra = dict(extra_keys=jax.vmap(lambda r, i: r[i])(rows, jnp.maximum(row_idx, 0)),
                         extra_bias=jnp.where(row_idx >= 0, 0.0, NEG_INF))
        o = kernels.chunk_attention(q, kv.astype(keys.dtype), start, n_new, ls["window_kv"],
                                    ls["window_pos"], p["sinks"], window=cfg.sliding_window,
                                    key_floor=window_floor, **extra,
                                    **chunk_query_prep(cos, sin, cfg, cfg.q_head_norm))
    elif code:
        # Only the selected rows are read (at most index_topk per query), not the whole
        # buffer: the same softmax over window, selected rows and sink (§2.8).
        row_idx = selected_rows(shared["selected"][code], cfg.index_topk)
        o = kernels.sparse_attention(q, keys, bias, rows, row_idx, p["sinks"])
    else:
        o = kernels.attention(q, keys, bias, p["sinks"])
    return output_projection(p, o, cos, sin, cfg), new_ls, shared
