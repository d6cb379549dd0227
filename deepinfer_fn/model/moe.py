"""Mixture of experts: sqrt-softplus score router or hash router, clipped SwiGLU experts,
sorted grouped-GEMM dispatch through the kernel registry, shared expert (spec §2.9)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_fn import kernels
from deepinfer_fn.config import HASH_MOE, ModelConfig
from deepinfer_fn.model.common import linear


def route(p, x, token_ids, mlp_type: str, cfg: ModelConfig):
    """Expert ids [N,k] int32 and weights [N,k] fp32 for tokens x [N,D] (ids [N])."""
    scores = jnp.sqrt(jax.nn.softplus(linear(x, p["gate"]))).astype(jnp.float32)
    if mlp_type == HASH_MOE:
        idx = p["tid2eid"][token_ids]
    else:
        _, idx = jax.lax.top_k(scores + p["gate_bias"].astype(jnp.float32),
                               cfg.num_experts_per_tok)
    chosen = jnp.take_along_axis(scores, idx, axis=-1)
    weights = chosen / (chosen.sum(-1, keepdims=True) + 1e-20) * cfg.routed_scaling_factor
    return idx.astype(jnp.int32), weights


def swiglu(gate, up, limit: float):
    """silu(min(gate, limit)) * clip(up, -limit, limit) (§2.9)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(gate.dtype)


def dense_expert(p, x, limit: float):
    return linear(swiglu(linear(x, p["w1"]), linear(x, p["w3"]), limit), p["w2"])


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
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(n, k, -1)
    out = jnp.einsum("nk,nkd->nd", weights, y.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    return out.astype(x.dtype)


def moe_layer(p, x, token_ids, mlp_type: str, cfg: ModelConfig):
    """MoE block: x [B,T,D] (after ffn_norm), token_ids [B,T] -> [B,T,D]."""
    B, T, D = x.shape
    flat_x = x.reshape(B * T, D)
    idx, weights = route(p, flat_x, token_ids.reshape(-1), mlp_type, cfg)
    if "logical_to_phys" in p:  # redundant experts: spread each expert's tokens over replicas
        from shardings.balancer import route_to_replicas
        idx = route_to_replicas(idx, jnp.arange(B * T, dtype=jnp.int32), p["logical_to_phys"],
                                p["replica_count"])
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.size > 1:
        # Expert parallelism: explicit dispatch / combine collectives (shardings/moe.py).
        from shardings.moe import ep_routed_experts
        out = ep_routed_experts(p, flat_x, idx, weights, cfg.swiglu_limit, mesh)
    else:
        out = routed_experts(p, flat_x, idx, weights, cfg.swiglu_limit)
    if "shared" in p:
        out = out + dense_expert(p["shared"], flat_x, cfg.swiglu_limit)
    return out.reshape(B, T, D)
