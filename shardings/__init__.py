"""Sharding: named meshes, logical-axis rules, expert-parallel dispatch and load balancing."""

from shardings.balancer import Placement, plan_replicas, replicate_experts, route_to_replicas
from shardings.mesh import (RULES, batch_shards, make_mesh, mesh_of, param_shardings,
                            shard_params, state_shardings)

__all__ = ["Placement", "plan_replicas", "replicate_experts", "route_to_replicas",
           "RULES", "batch_shards", "make_mesh", "mesh_of", "param_shardings", "shard_params",
           "state_shardings"]
