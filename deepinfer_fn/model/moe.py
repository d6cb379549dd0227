"""Mixture of experts: sqrt-softplus score router or hash router, clipped SwiGLU experts,
sorted grouped-GEMM dispatch through the kernel registry, shared expert (spec §2.9).
Under a mesh the routed experts run expert-parallel (`shardings.moe`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_fn.config import HASH_MOE, ModelConfig
from deepinfer_fn.model.common import linear, linear_many
from deepinfer_fn.model.experts import dense_expert, dense_expert_of, routed_experts, swiglu
# Module imports (attributes read at call time): shardings/__init__ imports deepinfer_fn.
from shardings import balancer, moe as expert_parallel

__all__ = ["route", "route_of", "moe_layer", "swiglu", "dense_expert", "routed_experts"]


def route(p, x, token_ids, mlp_type: str, cfg: ModelConfig):
    """Expert ids [N,k] int32 and weights [N,k] fp32 for tokens x [N,D] (ids [N])."""
    return route_of(p, linear(x, p["gate"]), token_ids, mlp_type, cfg)


def route_of(p, x_gate, token_ids, mlp_type: str, cfg: ModelConfig):
    """`route` from the router logits x @ gate [N, E]."""
    scores = jnp.sqrt(jax.nn.softplus(x_gate)).astype(jnp.float32)
    if mlp_type == HASH_MOE:
        idx = p["tid2eid"][token_ids]
    else:
        _, idx = jax.lax.top_k(scores + p["gate_bias"].astype(jnp.float32),
                               cfg.num_experts_per_tok)
    chosen = jnp.take_along_axis(scores, idx, axis=-1)
    weights = chosen / (chosen.sum(-1, keepdims=True) + 1e-20) * cfg.routed_scaling_factor
    return idx.astype(jnp.int32), weights


def moe_layer(p, x, token_ids, mlp_type: str, cfg: ModelConfig):
    """MoE block: x [B,T,D] (after ffn_norm), token_ids [B,T] -> [B,T,D]."""
    B, T, D = x.shape
    flat_x = x.reshape(B * T, D)
    if "shared" in p:   # the router and the shared expert read the same input: one linear_many
        x_gate, x_w1, x_w3 = linear_many(flat_x, (p["gate"], p["shared"]["w1"],
                                                  p["shared"]["w3"]))
    else:
        x_gate = linear(flat_x, p["gate"])
    idx, weights = route_of(p, x_gate, token_ids.reshape(-1), mlp_type, cfg)
    if "logical_to_phys" in p:  # redundant experts: spread each expert's tokens over replicas
        idx = balancer.route_to_replicas(idx, jnp.arange(B * T, dtype=jnp.int32),
                                         p["logical_to_phys"], p["replica_count"])
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.size > 1:
        # Expert parallelism: explicit dispatch / combine collectives (shardings/moe.py).
        out = expert_parallel.ep_routed_experts(p, flat_x, idx, weights, cfg.swiglu_limit, mesh)
    else:
        out = routed_experts(p, flat_x, idx, weights, cfg.swiglu_limit)
    if "shared" in p:
        out = out + dense_expert_of(p["shared"], x_w1, x_w3, cfg.swiglu_limit)
    return out.reshape(B, T, D)
