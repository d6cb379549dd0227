"""Sharding: named meshes, logical-axis rules, expert-parallel dispatch and load balancing."""

from shardings.mesh import (RULES, batch_shards, make_mesh, mesh_of, param_shardings,
                            shard_params, state_shardings)

__all__ = ["RULES", "batch_shards", "make_mesh", "mesh_of", "param_shardings", "shard_params",
           "state_shardings"]
