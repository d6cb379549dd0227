"""Expert computation of a MoE block (spec §2.9): clipped SwiGLU, a dense expert, and the
routed experts of one device as sorted grouped GEMMs through the kernel registry. Shared by
the single-device MoE layer (`model.moe`) and the expert-parallel dispatch (`shardings.moe`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_fn import kernels
from deepinfer_fn.model.common import linear


def swiglu(gate, up, limit: float):
    """silu(min(gate, limit)) * clip(up, -limit, limit) (§2.9)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(gate.dtype)



def dense_expert(p, x, limit: float):
    return linear(swiglu(linear(x, p["w1"]), linear(x, p["w3"]), limit), p["w2"])



def unsort(rows_sorted, order):
    """Rows back in their original order: out[order[i]] = rows_sorted[i], as a gather by the
    inverse permutation (an int scatter of len(order)), not a scatter of the rows themselves
    (an XLA:GPU row scatter of a prefill's MoE rows costs milliseconds)."""
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return rows_sorted[inverse]


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
    group_sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    gate = kernels.grouped_matmul(x_sorted, p["w1"], group_sizes)
    up = kernels.grouped_matmul(x_sorted, p["w3"], group_sizes)
    y_sorted = kernels.grouped_matmul(swiglu(gate, up, limit), p["w2"], group_sizes)
    y = unsort(y_sorted, order).reshape(n, k, -1)
    out = jnp.einsum("nk,nkd->nd", weights, y.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    return out.astype(x.dtype)
