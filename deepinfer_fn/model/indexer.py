"""Lightning indexer: scores compressed rows per query and keeps the top-k (spec §2.7, §4.5)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_fn import kernels
from deepinfer_fn.model.common import linear
from deepinfer_fn.model.rope import apply_rope


def index_queries(p, c_q, x, cos, sin, cfg):
    """Indexer queries q_I [B,T,H_I,d_I] (compress RoPE, no norm) and head weights [B,T,H_I]."""
    B, T, _ = c_q.shape
    q = linear(c_q, p["wq_b"]).reshape(B, T, cfg.index_n_heads, cfg.index_head_dim)
    q = apply_rope(q, cos[:, :, None], sin[:, :, None])
    w = linear(x, p["weights_proj"]).astype(jnp.float32) * cfg.index_n_heads ** -0.5
    return q, w


def index_scores(q_index, head_weights, index_rows):
    """I(t, w) = sum_h omega_h relu(q_h . K_w) / sqrt(d_I), fp32: -> [B, T, N]
    (the registry op `kernels.index_scores`)."""
    return kernels.index_scores(q_index, head_weights, index_rows)


def top_k_rows(scores, visible, k: int):
    """Row indices [B,T,min(k,N)] of the best visible rows, -1 where a selected row is
    invisible: invisible rows are masked to -inf before top-k and dropped after (§4.5).
    Ties go to the lower row index. The registry op `kernels.top_k_rows` (its order of the
    indices depends on the implementation; the set does not)."""
    return kernels.top_k_rows(scores, visible, k)


def select_top_k(scores, visible, k: int):
    """Boolean [B,T,N] form of `top_k_rows` (the registry op `kernels.top_k_mask`)."""
    return kernels.top_k_mask(scores, visible, k)
