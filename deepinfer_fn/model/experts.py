"""Expert computation of a MoE block (spec §2.9): clipped SwiGLU, a dense expert, and the
routed experts of one device as sorted grouped GEMMs through the kernel registry. Shared by
the single-device MoE layer (`model.moe`) and the expert-parallel dispatch (`shardings.moe`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_fn import kernels
from deepinfer_fn.model.common import linear, linear_many, swiglu





def dense_expert(p, x, limit: float):
    """A SwiGLU expert on x [N, D] -> [N, D]."""
    return dense_expert_of(p, *linear_many(x, (p["w1"], p["w3"])), limit)


def dense_expert_of(p, x_w1, x_w3, limit: float):
    """`dense_expert` from the input's projections x @ w1, x @ w3 [N, I]."""
    return linear(swiglu(x_w1, x_w3, limit), p["w2"])



# Up to this many (token, expert) slots, the integer bookkeeping of `routed_experts` (expert
# counts, the unsorting permutation) runs as one-hot / comparison reductions: one kernel
# each, where a scatter needs a zeroed buffer (XLA hoists the zeros out of a scanned layer
# stack and copies them back in every layer). Decode steps and verify chunks; prefill chunks
# scatter.
ONE_HOT_MAX = 1024


def counts(flat, n: int):
    """Occurrences of 0..n-1 in the int vector `flat`: jnp.bincount(flat, length=n), int32."""
    if flat.shape[0] <= ONE_HOT_MAX:
        return (flat[:, None] == jnp.arange(n, dtype=flat.dtype)).sum(0, dtype=jnp.int32)
    return jnp.bincount(flat, length=n).astype(jnp.int32)


def inverse_permutation(order):
    """inverse with inverse[order[i]] = i, of a permutation `order` of 0..n-1."""
    n = order.shape[0]
    iota = jnp.arange(n, dtype=order.dtype)
    if n <= ONE_HOT_MAX:
        return jnp.where(order[:, None] == iota[None], iota[:, None], 0).sum(0, dtype=order.dtype)
    return jnp.zeros_like(order).at[order].set(iota)


def sorted_positions(flat, order):
    """Where each entry of the int vector `flat` lands in its stable sort `order` (=
    jnp.argsort(flat, stable=True)): the inverse permutation of `order`. Up to ONE_HOT_MAX
    entries as ranks of the distinct keys flat * n + i (one reduction, independent of the
    sort), else `inverse_permutation(order)`."""
    n = flat.shape[0]
    if n <= ONE_HOT_MAX:
        key = flat * n + jnp.arange(n, dtype=flat.dtype)
        ranks = (key[None, :] < key[:, None]).sum(1, dtype=order.dtype)
        # Computed once: XLA:GPU otherwise fuses the n x n reduction into the consumers of
        # the gathered rows and recomputes it for every element they write.
        return jax.lax.optimization_barrier(ranks)
    return inverse_permutation(order)


def unsort(rows_sorted, order):
    """Rows back in their original order: out[order[i]] = rows_sorted[i], as a gather by the
    inverse permutation (an int scatter of len(order), or a one-hot reduction), not a scatter
    of the rows themselves (an XLA:GPU row scatter of a prefill's MoE rows costs
    milliseconds)."""
    return rows_sorted[inverse_permutation(order)]


def routed_experts(p, x, idx, weights, limit: float):
    """sum_i w_i * expert_{idx_i}(x) with tokens sorted by expert and grouped GEMMs.

    x [N,D], idx/weights [N,k] -> [N,D]. Each token's k contributions are summed in slot
    order, independent of the batch (batch invariance).
    """
    n, k = idx.shape
    n_experts = p["w1"].shape[0]
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    x_sorted = x[order // k]
    group_sizes = counts(flat, n_experts)
    h = kernels.grouped_swiglu(x_sorted, p["w1"], p["w3"], group_sizes, limit=limit)
    y_sorted = kernels.grouped_matmul(h, p["w2"], group_sizes)
    y = y_sorted[sorted_positions(flat, order)].reshape(n, k, -1)   # unsort
    out = jnp.einsum("nk,nkd->nd", weights, y.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    return out.astype(x.dtype)
