"""Attention of a chunk of new tokens against a decode state (docs/MODEL.md §3, §4).

One code path for prefill chunks of any size, single-token decode and k-token verification.
Row b processes its first n_new[b] tokens of the chunk at positions start[b] + j; the rest of
the chunk is padding that neither reads nor writes state. Returns the layer's output and its
new state; the caller advances `lengths`.

Stacked state (a scanned layer group, `layer_groups.py`): with `layer` = the layer's index
r in its group, every state leaf is [repeats, B, ...] and layer r's entries are read at
[r] and written IN PLACE as scatters at [r, b, slot] (ring slots, new rows), never by
rebuilding the layer's state; the returned dict holds the whole stacked arrays. A ring is
read before it is written: its writes take their values through `_write_after` with a result
that every read of the ring feeds (the layer's attention output; for `compressor_chunk` alone
its new rows), so the writes stay in place (otherwise XLA copies the whole ring to keep the
old entries alive) while the reads stay free to fuse into their consumers (no kernel that
copies a layer's ring out of the stack, no copy of an unstacked ring).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_fn import kernels
from deepinfer_fn.config import CSA, HCA, ModelConfig
from deepinfer_fn.model.attention import (DECODE_CHUNK_MAX, NEG_INF, chunk_query_prep,
                                         output_projection, query_and_kv_of, window_bias)
from deepinfer_fn.model.common import linear_many
from deepinfer_fn.model.compressor import finish_rows, inputs_of, pool_windows
from deepinfer_fn.model.indexer import index_queries, index_scores, select_top_k, top_k_rows
from deepinfer_fn.model.rope import rope_cos_sin, rope_frequencies


# A prefill chunk of a CSA layer scores every compressed row, the unselected ones masked,
# while the layer holds at most this many rows; beyond, each token's selection is gathered.
DENSE_ROWS_MAX = 4096


def _gather_tokens(ext, idx):
    """ext [B, L, C], idx [B, ...] -> [B, ..., C]."""
    return jax.vmap(lambda e, i: e[i])(ext, idx)


def _read(st: dict, key: str, layer):
    """Layer `layer`'s entry [B, ...] of a state leaf (the leaf itself when unstacked)."""
    return st[key] if layer is None else st[key][layer]


def _write_after(anchor, writes):
    """(anchor, writes) unchanged, with every value to be written depending on `anchor`: the
    in-place scatters of a ring cannot be scheduled before the ring's old entries are read,
    as long as every read of the ring feeds `anchor`. writes: (key, slot, values) triples
    (only the values pass the barrier)."""
    anchor, values = jax.lax.optimization_barrier((anchor, [v for _, _, v in writes]))
    return anchor, [(k, slot, v) for (k, slot, _), v in zip(writes, values)]


def _apply_writes(st: dict, layer, writes, out: dict | None = None) -> dict:
    """`out` (default {}) with each (key, slot [B, S], values [B, S, ...]) of `writes` put into
    st[key] (`_put_rows`)."""
    out = {} if out is None else out
    for key, slot, values in writes:
        out[key] = _put_rows(st[key], layer, slot, values)
    return out


def _put_rows(buf, layer, idx, values):
    """buf [(repeats,) B, N, ...] with values [B, K, ...] written at [(layer,) b, idx[b, k]]
    (idx out of range: dropped).

    A single row (B = K = 1: a batch-1 decode step) is written as two, the second always
    dropped: XLA turns a one-row scatter into a dynamic-update-slice plus a separate kernel
    that reads the old row (the dropped case), where a scatter is one kernel."""
    if idx.shape == (1, 1):
        idx = jnp.concatenate([idx, jnp.full_like(idx, buf.shape[-values.ndim + 1])], 1)
        values = jnp.concatenate([values, values], 1)
    b = jnp.arange(idx.shape[0])[:, None]
    where = (b, idx) if layer is None else (layer, b, idx)
    return buf.at[where].set(values.astype(buf.dtype), mode="drop")


def compressor_chunk(p, x, start, n_new, ratio: int, overlap: bool, freqs, eps: float,
                     st: dict, prefix: str = "", row_floor=None, layer=None):
    """`_compressor_rows` with the ring writes applied (ordered after the new rows, which
    every read of the ring feeds). Returns the updated entries."""
    out, writes = _compressor_rows(p, linear_many(x, (p["wkv"], p["wgate"])), start, n_new,
                                   ratio, overlap, freqs, eps, st, prefix, row_floor, layer)
    (out, writes) = _write_after(out, writes)
    return _apply_writes(st, layer, writes, out)


def _compressor_rows(p, x_proj, start, n_new, ratio: int, overlap: bool, freqs, eps: float,
                     st: dict, prefix: str = "", row_floor=None, layer=None):
    """Advances one compressor over a chunk: emits the rows of every window the chunk
    completes (at index = global window number, RoPE at m * w, §4.3, §4.8) and writes the
    chunk's raw per-token inputs into the compressor ring.

    The ring (`{prefix}raw_kv` [B, R_c, c*dim], `{prefix}raw_gate` f32) holds the raw kappa and
    gate + ape of the last processed positions at slot `position % R_c`. A window is pooled
    from ring ∪ chunk (ring entries only for positions < start, chunk entries for the rest),
    CSA taking the A-halves of window w-1 from the same place (-inf gates before position 0).
    Nothing is "rolled": every read is addressed by position, so moving `lengths` back over
    rejected tokens is a complete rollback as long as R_c leaves room for them (state.py).

    x_proj: the chunk's projections (x @ wkv, x @ wgate) [B,S,c*dim]; start/n_new [B].
    row_floor [B] (optional, token positions, a multiple of m): rows of windows starting below
    it are not written (they already hold exact shared rows: the engine's prefix-cache replay,
    docs/MODEL.md §7). layer: the index into stacked state leaves (module docstring) or None.
    Returns (the updated rows entry, the ring writes as (key, slot, values) for
    `_apply_writes`): the caller orders the ring writes after every use of the ring's old
    entries (`_write_after`).
    """
    B, S, _ = x_proj[0].shape
    m = ratio
    positions = start[:, None] + jnp.arange(S)
    kappa, gate = inputs_of(p, *x_proj, positions, m)
    ring_kv, ring_gate = _read(st, prefix + "raw_kv", layer), _read(st, prefix + "raw_gate", layer)
    slots = ring_kv.shape[1]
    kappa = kappa.astype(ring_kv.dtype)
    ext_kv = jnp.concatenate([ring_kv, kappa], 1)
    ext_gate = jnp.concatenate([ring_gate, gate], 1)
    end = start + n_new
    w0 = start // m

    def ext_index(pos):  # absolute position -> index into [ring | chunk]
        s = start.reshape((B,) + (1,) * (pos.ndim - 1))
        return jnp.clip(jnp.where(pos < s, pos % slots, slots + pos - s), 0, slots + S - 1)

    n_win = (m + S - 2) // m + 1                       # windows a chunk of S tokens can touch
    lead = 1 if overlap else 0                         # CSA also reads window w0 - 1
    win = w0[:, None] + jnp.arange(-lead, n_win)[None]  # [B, lead + n_win] global window numbers
    pos = win[:, :, None] * m + jnp.arange(m)          # [B, lead + n_win, m]
    win_kv = _gather_tokens(ext_kv, ext_index(pos))
    win_gate = _gather_tokens(ext_gate, ext_index(pos))

    out = {}
    if overlap:
        dim = win_kv.shape[-1] // 2
        prev_gate = jnp.where((win[:, 0] >= 0)[:, None, None], win_gate[:, 0, :, :dim], -jnp.inf)
        pooled = pool_windows(win_kv[:, 1:], win_gate[:, 1:], True, win_kv[:, 0, :, :dim],
                              prev_gate)
        win = win[:, 1:]
    else:
        pooled = pool_windows(win_kv, win_gate, False)
    complete = (win + 1) * m <= end[:, None]           # [B, n_win]
    if row_floor is not None:
        complete &= win >= (row_floor // m)[:, None]
    rows = st[prefix + "rows"]
    new_rows = finish_rows(p, pooled, win, m, freqs, eps).astype(rows.dtype)
    cap = rows.shape[-2]
    target = jnp.where(complete, win, cap)             # out of range -> dropped
    out[prefix + "rows"] = _put_rows(rows, layer, target, new_rows)

    # Ring update: the chunk's valid tokens that a later chunk can still read.
    write = (jnp.arange(S)[None] < n_new[:, None]) & (positions >= (end - slots)[:, None])
    slot = jnp.where(write, positions % slots, slots)
    return out, [(prefix + "raw_kv", slot, kappa), (prefix + "raw_gate", slot, gate)]


def _input_projections(p, x, layer_type: str) -> dict:
    """x @ every weight of the layer that reads the attention input x [B,S,D], as one
    `linear_many`: {"wq_a", "wkv": [B,S,N]; "compressor", "index_compressor": (x @ wkv,
    x @ wgate) where the layer has them}."""
    named = {"wq_a": p["wq_a"], "wkv": p["wkv"]}
    if layer_type in (CSA, HCA):
        named |= {"c_wkv": p["compressor"]["wkv"], "c_wgate": p["compressor"]["wgate"]}
    if layer_type == CSA:
        ic = p["indexer"]["compressor"]
        named |= {"i_wkv": ic["wkv"], "i_wgate": ic["wgate"]}
    ys = dict(zip(named, linear_many(x, tuple(named.values()))))
    out = {"wq_a": ys["wq_a"], "wkv": ys["wkv"]}
    if "c_wkv" in ys:
        out["compressor"] = (ys["c_wkv"], ys["c_wgate"])
    if "i_wkv" in ys:
        out["index_compressor"] = (ys["i_wkv"], ys["i_wgate"])
    return out


def attention_chunk(p, x, st: dict, start, n_new, layer_type: str, cfg: ModelConfig,
                    row_floor=None, layer=None):
    """Attention of a chunk against the layer state: (out [B,S,D], new layer state).

    row_floor [B] (optional): compressed rows (main and indexer) of windows starting below
    this position are kept as they are in the state instead of being rewritten
    (`compressor_chunk`). layer: index into stacked state leaves (module docstring)."""
    B, S, _ = x.shape
    positions = start[:, None] + jnp.arange(S, dtype=jnp.int32)
    valid = jnp.arange(S)[None] < n_new[:, None]
    end = start + n_new
    freqs = rope_frequencies(cfg, layer_type)
    cos, sin = rope_cos_sin(positions, freqs, x.dtype)
    proj = _input_projections(p, x, layer_type)
    blocked = S > DECODE_CHUNK_MAX   # prefill chunks: the window blocked (kernels.chunk_attention)
    q, c_q, kv = query_and_kv_of(p, proj["wq_a"], proj["wkv"], cos, sin, cfg, raw_query=blocked)
    kv = kv.astype(st["window_kv"].dtype)
    ring_kv, ring_pos = _read(st, "window_kv", layer), _read(st, "window_pos", layer)

    # Window branch: ring slots still behind `start` (rolled-back slots are ignored) + chunk.
    ring_pos = jnp.where(ring_pos < start[:, None], ring_pos, -1)
    chunk_pos = jnp.where(valid, positions, -1)
    window_kv = jnp.concatenate([ring_kv, kv], axis=1)
    bias = window_bias(positions, jnp.concatenate([ring_pos, chunk_pos], 1), cfg.sliding_window)

    def attend(extra_keys=None, extra_bias=None):
        return kernels.chunk_attention(q, kv, start, n_new, ring_kv, ring_pos, p["sinks"],
                                       window=cfg.sliding_window, extra_keys=extra_keys,
                                       extra_bias=extra_bias, **chunk_query_prep(cos, sin, cfg))

    new = dict(st)
    writes = []     # ring writes, applied after the attention (which every ring read feeds)
    if layer_type in (CSA, HCA):
        m = cfg.compress_ratio_of(layer_type)
        rows_out, ring_writes = _compressor_rows(p["compressor"], proj["compressor"], start,
                                                 n_new, m, layer_type == CSA, freqs,
                                                 cfg.rms_norm_eps, st, row_floor=row_floor,
                                                 layer=layer)
        new.update(rows_out)
        writes += ring_writes
        rows = _read(new, "rows", layer)
        visible = jnp.arange(rows.shape[1])[None, None] < ((positions + 1) // m)[:, :, None]
        if layer_type == CSA:
            ip = p["indexer"]
            rows_out, ring_writes = _compressor_rows(ip["compressor"], proj["index_compressor"],
                                                     start, n_new, m, True, freqs,
                                                     cfg.rms_norm_eps, st, prefix="index_",
                                                     row_floor=row_floor, layer=layer)
            new.update(rows_out)
            writes += ring_writes
            q_index, head_w = index_queries(ip, c_q, x, cos, sin, cfg)
            scores = index_scores(q_index, head_w, _read(new, "index_rows", layer))
            if not blocked:
                row_idx = top_k_rows(scores, visible, cfg.index_topk)
                o = kernels.sparse_attention(q, window_kv, bias, rows, row_idx, p["sinks"])
            elif rows.shape[1] <= DENSE_ROWS_MAX:   # every row, the unselected ones masked
                chosen = select_top_k(scores, visible, cfg.index_topk)
                o = attend(rows, jnp.where(chosen, 0.0, NEG_INF))
            else:                                   # each token's selected rows gathered
                row_idx = top_k_rows(scores, visible, cfg.index_topk)
                o = attend(_gather_tokens(rows, jnp.maximum(row_idx, 0)),
                           jnp.where(row_idx >= 0, 0.0, NEG_INF))
        elif blocked:
            o = attend(rows, jnp.where(visible, 0.0, NEG_INF))
        else:
            keys = jnp.concatenate([window_kv, rows], axis=1)
            bias = jnp.concatenate([bias, jnp.where(visible, 0.0, NEG_INF)], axis=-1)
            o = kernels.attention(q, keys, bias, p["sinks"])
    else:
        o = attend() if blocked else kernels.attention(q, window_kv, bias, p["sinks"])
    # Ring update: the chunk's valid tokens that can still be in a future window.
    slots = st["window_pos"].shape[-1]
    write = valid & (positions >= (end - slots)[:, None])
    slot = jnp.where(write, positions % slots, slots)
    writes += [("window_kv", slot, kv), ("window_pos", slot, positions)]
    o, writes = _write_after(o, writes)
    out = output_projection(p, o, cos, sin, cfg)
    return out, _apply_writes(st, layer, writes, new)
