"""Attention of a chunk of new tokens against a decode state (spec/model.md §3, §4).

One code path for prefill chunks of any size, single-token decode and k-token verification.
Row b processes its first n_new[b] tokens of the chunk at positions start[b] + j; the rest of
the chunk is padding that neither reads nor writes state. Returns the layer's output and its
new state; the caller advances `lengths`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_fn import kernels
from deepinfer_fn.config import CSA, HCA, ModelConfig
from deepinfer_fn.model.attention import NEG_INF, output_projection, query_and_kv, window_bias
from deepinfer_fn.model.compressor import finish_rows, pool_windows, project
from deepinfer_fn.model.indexer import index_queries, index_scores, top_k_rows
from deepinfer_fn.model.rope import rope_cos_sin, rope_frequencies


def _gather_tokens(ext, idx):
    """ext [B, L, C], idx [B, ...] -> [B, ..., C]."""
    return jax.vmap(lambda e, i: e[i])(ext, idx)


def compressor_chunk(p, x, start, n_new, ratio: int, overlap: bool, freqs, eps: float,
                     st: dict, prefix: str = ""):
    """Advances one compressor over a chunk: emits the rows of every window the chunk
    completes (at index = global window number, RoPE at m * w, §4.3, §4.8), re-buffers the
    unfinished window and, for CSA, the A-halves of the last finished window (§3.3).

    x [B,S,D]; start/n_new [B]. `st` holds `{prefix}rows`, `{prefix}part_kv`,
    `{prefix}part_gate` (+ `{prefix}ovl_kv`, `{prefix}ovl_gate` when overlapping).
    Returns the updated entries.
    """
    B, S, _ = x.shape
    m = ratio
    positions = start[:, None] + jnp.arange(S)
    kappa, gate = project(p, x, positions, m)
    ext_kv = jnp.concatenate([st[prefix + "part_kv"], kappa.astype(st[prefix + "part_kv"].dtype)], 1)
    ext_gate = jnp.concatenate([st[prefix + "part_gate"], gate], 1)
    end = start + n_new
    w0 = start // m
    window_start = w0 * m

    def ext_index(pos):  # absolute position -> index into [partial window | chunk]
        idx = jnp.where(pos < start.reshape((B,) + (1,) * (pos.ndim - 1)),
                        pos - window_start.reshape((B,) + (1,) * (pos.ndim - 1)),
                        m + pos - start.reshape((B,) + (1,) * (pos.ndim - 1)))
        return jnp.clip(idx, 0, m + S - 1)

    n_win = (m + S - 2) // m + 1                       # windows a chunk of S tokens can touch
    win = w0[:, None] + jnp.arange(n_win)[None]        # [B, n_win] global window numbers
    pos = win[:, :, None] * m + jnp.arange(m)          # [B, n_win, m]
    win_kv = _gather_tokens(ext_kv, ext_index(pos))
    win_gate = _gather_tokens(ext_gate, ext_index(pos))
    complete = (win + 1) * m <= end[:, None]           # [B, n_win]

    out = {}
    dim = win_kv.shape[-1] // (2 if overlap else 1)
    prev = (st[prefix + "ovl_kv"], st[prefix + "ovl_gate"]) if overlap else (None, None)
    pooled = pool_windows(win_kv, win_gate, overlap, *prev)
    new_rows = finish_rows(p, pooled, win, m, freqs, eps).astype(st[prefix + "rows"].dtype)
    cap = st[prefix + "rows"].shape[1]
    target = jnp.where(complete, win, cap)             # out of range -> dropped
    out[prefix + "rows"] = jax.vmap(lambda r, i, v: r.at[i].set(v, mode="drop"))(
        st[prefix + "rows"], target, new_rows)

    if overlap:
        last = end // m - 1 - w0                       # last window finished in this chunk
        has = last >= 0
        j = jnp.clip(last, 0, n_win - 1)
        a_kv = jax.vmap(lambda w, i: w[i, :, :dim])(win_kv, j)
        a_gate = jax.vmap(lambda w, i: w[i, :, :dim])(win_gate, j)
        out[prefix + "ovl_kv"] = jnp.where(has[:, None, None], a_kv, st[prefix + "ovl_kv"])
        out[prefix + "ovl_gate"] = jnp.where(has[:, None, None], a_gate, st[prefix + "ovl_gate"])

    fill = end % m
    part_pos = (end // m * m)[:, None] + jnp.arange(m)  # [B, m]
    keep = (jnp.arange(m)[None] < fill[:, None])[..., None]
    out[prefix + "part_kv"] = jnp.where(keep, _gather_tokens(ext_kv, ext_index(part_pos)), 0)
    out[prefix + "part_gate"] = jnp.where(keep, _gather_tokens(ext_gate, ext_index(part_pos)), 0.0)
    return out


def attention_chunk(p, x, st: dict, start, n_new, layer_type: str, cfg: ModelConfig):
    """Attention of a chunk against the layer state: (out [B,S,D], new layer state)."""
    B, S, _ = x.shape
    positions = start[:, None] + jnp.arange(S, dtype=jnp.int32)
    valid = jnp.arange(S)[None] < n_new[:, None]
    end = start + n_new
    freqs = rope_frequencies(cfg, layer_type)
    cos, sin = rope_cos_sin(positions, freqs, x.dtype)
    q, c_q, kv = query_and_kv(p, x, cos, sin, cfg)
    kv = kv.astype(st["window_kv"].dtype)

    # Window branch: ring slots still behind `start` (rolled-back slots are ignored) + chunk.
    ring_pos = jnp.where(st["window_pos"] < start[:, None], st["window_pos"], -1)
    chunk_pos = jnp.where(valid, positions, -1)
    window_kv = jnp.concatenate([st["window_kv"], kv], axis=1)
    bias = window_bias(positions, jnp.concatenate([ring_pos, chunk_pos], 1), cfg.sliding_window)

    new = dict(st)
    if layer_type in (CSA, HCA):
        m = cfg.compress_ratio_of(layer_type)
        new.update(compressor_chunk(p["compressor"], x, start, n_new, m, layer_type == CSA,
                                    freqs, cfg.rms_norm_eps, st))
        rows = new["rows"]
        visible = jnp.arange(rows.shape[1])[None, None] < ((positions + 1) // m)[:, :, None]
        if layer_type == CSA:
            ip = p["indexer"]
            new.update(compressor_chunk(ip["compressor"], x, start, n_new, m, True, freqs,
                                        cfg.rms_norm_eps, st, prefix="index_"))
            q_index, head_w = index_queries(ip, c_q, x, cos, sin, cfg)
            scores = index_scores(q_index, head_w, new["index_rows"])
            row_idx = top_k_rows(scores, visible, cfg.index_topk)
            o = kernels.sparse_attention(q, window_kv, bias, rows, row_idx, p["sinks"])
        else:
            keys = jnp.concatenate([window_kv, rows], axis=1)
            bias = jnp.concatenate([bias, jnp.where(visible, 0.0, NEG_INF)], axis=-1)
            o = kernels.attention(q, keys, bias, p["sinks"])
    else:
        o = kernels.attention(q, window_kv, bias, p["sinks"])
    out = output_projection(p, o, cos, sin, cfg)

    # Ring update: the chunk's valid tokens that can still be in a future window.
    slots = st["window_pos"].shape[1]
    write = valid & (positions >= (end - slots)[:, None])
    slot = jnp.where(write, positions % slots, slots)
    new["window_kv"] = jax.vmap(lambda r, i, v: r.at[i].set(v, mode="drop"))(st["window_kv"], slot, kv)
    new["window_pos"] = jax.vmap(lambda r, i, v: r.at[i].set(v, mode="drop"))(
        st["window_pos"], slot, positions)
    return out, new
