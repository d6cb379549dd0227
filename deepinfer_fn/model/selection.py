"""DeepSeek-V4.1 top-k selection: index scores, full top-k and the candidate-block prefilter
(docs/MODEL.md §V2.4, §V2.5).

* Scores I(t, j) = sum_h omega_h relu(q_h . K_j), omega = (x @ weights_proj) / sqrt(H_I d_I),
  with the scoring layer's own queries against its kv source's index keys (`model.indexer`).
* Full top-k (index sources): the min(index_topk, N_t) best visible rows.
* Candidate publish (the candidate source, besides its own full top-k): rows in blocks of
  `candidate_block_size`; a block's score is the max over its visible rows, the block holding
  the newest visible row gets +inf; keep the min(candidate_topk_blocks, ceil(N_t / block))
  best blocks, per query row.
* Candidate consume: the consumer's own scores, restricted to visible rows inside the
  published blocks of the same query row, then the top min(index_topk, #candidates).
Selections are boolean masks [B, T, N] over the code's rows. Ties go to the lower index.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_fn.config import ModelConfig
from deepinfer_fn.model.indexer import index_queries, index_scores, select_top_k


def scores(ip, c_q: jax.Array, x: jax.Array, keys: jax.Array, cos, sin,
           cfg: ModelConfig) -> jax.Array:
    """I(t, j) fp32 [B, T, N]: c_q [B, T, q_lora], x [B, T, D] (attention input), keys
    [B, N, d_I] (the kv source's index keys), cos/sin of the query positions (compress
    table)."""
    q_index, head_w = index_queries(ip, c_q, x, cos, sin, cfg)
    return index_scores(q_index, head_w, keys)


def full_top_k(row_scores: jax.Array, visible: jax.Array, k: int) -> jax.Array:
    """bool [B, T, N]: the min(k, N_t) best visible rows of each query."""
    assert row_scores.shape == visible.shape, (row_scores.shape, visible.shape)
    return select_top_k(row_scores, visible, k)


def _blocked(x: jax.Array, block: int, fill) -> jax.Array:
    """[..., N] -> [..., ceil(N / block), block], padded with `fill`."""
    n = x.shape[-1]
    nb = -(-n // block)
    pad = [(0, 0)] * (x.ndim - 1) + [(0, nb * block - n)]
    return jnp.pad(x, pad, constant_values=fill).reshape(*x.shape[:-1], nb, block)


def candidate_blocks(row_scores: jax.Array, visible: jax.Array, block: int,
                     keep: int) -> jax.Array:
    """The published candidate blocks: bool [B, T, ceil(N / block)] (module docstring).

    row_scores fp32 [B, T, N]; visible bool [B, T, N] (a prefix of the rows per query)."""
    assert row_scores.shape == visible.shape, (row_scores.shape, visible.shape)
    if block < 1 or keep < 1:
        raise ValueError(f"candidate_blocks: block={block} and keep={keep} must be >= 1")
    masked = jnp.where(visible, row_scores.astype(jnp.float32), -jnp.inf)
    block_score = jnp.max(_blocked(masked, block, -jnp.inf), axis=-1)
    block_visible = jnp.any(_blocked(visible, block, False), axis=-1)
    n_visible = jnp.sum(visible, axis=-1)
    newest = jnp.arange(block_score.shape[-1]) == ((n_visible - 1) // block)[..., None]
    block_score = jnp.where(newest & (n_visible > 0)[..., None], jnp.inf, block_score)
    return select_top_k(block_score, block_visible, keep)


def within_blocks(visible: jax.Array, blocks: jax.Array, block: int) -> jax.Array:
    """Visible rows inside the kept blocks: visible [B, T, N], blocks [B, T, NB] -> [B, T, N]."""
    n = visible.shape[-1]
    in_block = jnp.repeat(blocks, block, axis=-1)[..., :n]
    return visible & in_block


def candidate_top_k(row_scores: jax.Array, visible: jax.Array, blocks: jax.Array, block: int,
                    k: int) -> jax.Array:
    """A consumer's selection: the top min(k, #candidates) visible rows inside the published
    blocks, bool [B, T, N]."""
    return select_top_k(row_scores, within_blocks(visible, blocks, block), k)


def selected_rows(chosen: jax.Array, k: int) -> jax.Array:
    """The indices of a selection mask: chosen bool [B, T, N] (at most k per query) -> int32
    [B, T, min(k, N)] in increasing row order, -1 past the last selected row (the row_idx of
    `kernels.sparse_attention`)."""
    B, T, N = chosen.shape
    k = min(k, N)
    slot = jnp.cumsum(chosen, axis=-1, dtype=jnp.int32) - 1
    slot = jnp.where(chosen & (slot < k), slot, k)             # out of range: dropped
    b = jnp.arange(B)[:, None, None]
    t = jnp.arange(T)[None, :, None]
    rows = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), chosen.shape)
    return jnp.full((B, T, k), -1, jnp.int32).at[b, t, slot].set(rows, mode="drop")
