"""V4 attention over a whole sequence: window / CSA / HCA with sinks (spec §2.5-§2.8, §4)."""

from __future__ import annotations

import jax.numpy as jnp

from deepinfer_fn import kernels
from deepinfer_fn.config import CSA, HCA, ModelConfig
from deepinfer_fn.model.common import grouped_linear, head_rms, linear, rms_norm
from deepinfer_fn.model.compressor import compress_sequence
from deepinfer_fn.model.indexer import index_queries, index_scores, select_top_k
from deepinfer_fn.model.rope import (apply_rope, apply_rope_in_place, rope_cos_sin,
                                     rope_frequencies)

NEG_INF = -jnp.inf
# Chunks and sequences of more than this many tokens (prefill, whole-sequence forward) attend
# through `kernels.chunk_attention` (the window in blocks: T x 2W logits instead of T x T);
# decode steps and verify chunks through the decode kernels.
DECODE_CHUNK_MAX = 16


def query_and_kv(p, x, cos, sin, cfg: ModelConfig, raw_query: bool = False):
    """q [B,T,H,d] (head-normed, rotated), c_q [B,T,q_lora], kv [B,T,d] (normed, rotated)."""
    return query_and_kv_of(p, linear(x, p["wq_a"]), linear(x, p["wkv"]), cos, sin, cfg,
                           raw_query)


def query_and_kv_of(p, x_wq_a, x_wkv, cos, sin, cfg: ModelConfig, raw_query: bool = False):
    """`query_and_kv` from the input's projections x @ wq_a [B,T,q_lora], x @ wkv [B,T,d].
    raw_query: q before its head norm and rotation (`kernels.chunk_attention` applies them
    from `chunk_query_prep`)."""
    B, T, _ = x_wq_a.shape
    eps = cfg.rms_norm_eps
    c_q = rms_norm(x_wq_a, p["q_norm"], eps)
    q = linear(c_q, p["wq_b"]).reshape(B, T, cfg.num_attention_heads, cfg.head_dim)
    if not raw_query:
        q = apply_rope(head_rms(q, eps), cos[:, :, None], sin[:, :, None])
    kv = apply_rope(rms_norm(x_wkv, p["kv_norm"], eps), cos, sin)
    return q, c_q, kv


def chunk_query_prep(cos, sin, cfg: ModelConfig, head_norm: bool = True) -> dict:
    """`kernels.chunk_attention`'s arguments for a raw query (`query_and_kv(raw_query=True)`):
    its head norm (when head_norm) and rotation."""
    return dict(q_norm_eps=cfg.rms_norm_eps if head_norm else None, q_rope=(cos, sin))


def kv_projection(p, x, cos, sin, cfg: ModelConfig):
    """The shared key=value latent: kv_norm(x @ wkv), rotated: x [B,T,D] -> [B,T,d] (§2.5).
    Also the DSpark context injection (docs/MODEL.md §D1.3: each draft stage projects the
    target features through its own wkv/kv_norm)."""
    kv = rms_norm(linear(x, p["wkv"]), p["kv_norm"], cfg.rms_norm_eps)
    return apply_rope(kv, cos, sin)


def output_projection(p, o, cos, sin, cfg: ModelConfig):
    """De-rotate each head at the query position, grouped wo_a, then wo_b (§2.8)."""
    B, T, H, d = o.shape
    # Prefill chunks rewrite only the rotated channels of their large output.
    rotate = apply_rope_in_place if T > DECODE_CHUNK_MAX else apply_rope
    o = rotate(o, cos[:, :, None], sin[:, :, None], inverse=True)
    z = grouped_linear(o.reshape(B * T, cfg.o_groups, H // cfg.o_groups * d), p["wo_a"])
    return linear(z.reshape(B, T, -1), p["wo_b"])


def window_bias(q_pos, k_pos, window: int):
    """0 where key position s is in (t - window, t], else -inf: [B,T] x [B,S] -> [B,T,S]."""
    t, s = q_pos[:, :, None], k_pos[:, None, :]
    ok = (s <= t) & (s > t - window) & (s >= 0)
    return jnp.where(ok, 0.0, NEG_INF).astype(jnp.float32)


def row_visibility(q_pos, n_rows: int, ratio: int):
    """Row w is visible to query t iff w < floor((t+1)/m) (§4.2): [B,T] -> bool [B,T,N]."""
    return jnp.arange(n_rows)[None, None, :] < ((q_pos + 1) // ratio)[:, :, None]


def attention_sequence(p, x, positions, layer_type: str, cfg: ModelConfig):
    """Attention of one layer over a full sequence from position 0 (no cache).

    x [B,T,D] (after attn_norm); positions [B,T] = arange(T). Returns [B,T,D].
    """
    freqs = rope_frequencies(cfg, layer_type)
    cos, sin = rope_cos_sin(positions, freqs, x.dtype)
    blocked = x.shape[1] > DECODE_CHUNK_MAX
    q, c_q, kv = query_and_kv(p, x, cos, sin, cfg, raw_query=blocked)
    rows = visible = None
    if layer_type in (CSA, HCA):
        ratio = cfg.compress_ratio_of(layer_type)
        rows = compress_sequence(p["compressor"], x, ratio, layer_type == CSA, freqs,
                                 cfg.rms_norm_eps).astype(kv.dtype)
        visible = row_visibility(positions, rows.shape[1], ratio)
        if layer_type == CSA:
            ip = p["indexer"]
            index_rows = compress_sequence(ip["compressor"], x, ratio, True, freqs,
                                           cfg.rms_norm_eps)
            q_index, head_w = index_queries(ip, c_q, x, cos, sin, cfg)
            scores = index_scores(q_index, head_w, index_rows)
            visible = select_top_k(scores, visible, cfg.index_topk)
    if blocked:
        o = windowed(p, q, kv, rows, visible, cfg, **chunk_query_prep(cos, sin, cfg))
    else:
        keys, bias = kv, window_bias(positions, positions, cfg.sliding_window)
        if rows is not None:
            keys = jnp.concatenate([kv, rows], axis=1)
            bias = jnp.concatenate([bias, jnp.where(visible, 0.0, NEG_INF)], axis=-1)
        o = kernels.attention(q, keys, bias, p["sinks"])
    return output_projection(p, o, cos, sin, cfg)


def windowed(p, q, kv, rows, visible, cfg: ModelConfig, **query_prep):
    """Whole-sequence attention (q [B,T,H,d], kv [B,T,d]) as one chunk from position 0
    against an empty window ring; rows [B,N,d] (or None) as extra keys under their
    visibility / selection mask visible [B,T,N] bool; query_prep: `chunk_query_prep`."""
    B, T = kv.shape[:2]
    W = cfg.sliding_window
    extra = {} if rows is None else dict(extra_keys=rows,
                                         extra_bias=jnp.where(visible, 0.0, NEG_INF))
    return kernels.chunk_attention(q, kv, jnp.zeros((B,), jnp.int32), jnp.full((B,), T, jnp.int32),
                                   jnp.zeros((B, W, kv.shape[-1]), kv.dtype),
                                   jnp.full((B, W), -1, jnp.int32), p["sinks"], window=W,
                                   **extra, **query_prep)
