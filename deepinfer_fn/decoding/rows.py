"""The rows a decode loop runs: mesh padding, per-row sampling parameters, state placement.

On a sharded mesh the batch is split over the mesh's batch shards (dp x ep), so it is padded
to a multiple of them with 1-token dummy rows; the loops mark rows >= B done from the start and
slice them off the outputs.
"""

from __future__ import annotations

import jax
import numpy as np

from deepinfer_fn.api import mesh_context, pad_batch
from deepinfer_fn.sampling import sampling_params
import shardings.mesh as sharding_mesh


def mesh_rows(params, tokens, lengths, temperature, top_k, top_p, min_p, seed):
    """(mesh or None, tokens [Bp, T], lengths [Bp], SamplingParams [Bp]). On a sharded mesh
    the padding rows copy row 0's sampling arguments."""
    mesh, _ = mesh_context(params)
    if mesh is not None:
        shards = sharding_mesh.batch_shards(mesh)
        tokens, lengths = pad_batch(tokens, shards), pad_batch(lengths, shards, fill=1)
        per_row = lambda v: (v if v is None or np.ndim(v) == 0
                             else pad_batch(np.asarray(v), shards, np.asarray(v)[0]))
        temperature, top_k, top_p, min_p, seed = map(per_row, (temperature, top_k, top_p, min_p,
                                                               seed))
    sampling = sampling_params(tokens.shape[0], temperature, top_k, top_p, min_p, seed)
    return mesh, tokens, lengths, sampling


def rows_per_device(mesh, rows: int) -> int:
    """Rows each device runs of a `rows`-row batch (all of them without a mesh)."""
    return rows if mesh is None else rows // sharding_mesh.batch_shards(mesh)


def on_mesh(tree, mesh):
    """A decode state (the target's or a drafter's) split over the mesh's batch axes."""
    if mesh is None:
        return tree
    return jax.device_put(tree, sharding_mesh.state_shardings(tree, mesh))


def replicated(tree, mesh):
    """A full copy of `tree` on every device of the mesh (small drafters' weights)."""
    if mesh is None:
        return tree
    return jax.device_put(tree, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
