"""Named meshes and logical-axis rules: the one place that maps model axes to devices.

Mesh axes: `dp` (attention data parallel), `ep` (expert parallel), `tp` (tensor parallel,
optional). Attention is data-parallel over every device (the batch is split over dp x ep, as
DeepInfer's DP64/EP64 decode does); routed experts are split over `ep` and replicated over
`dp`; dense weights are replicated (or split over `tp` along the axes the rules name).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from deepinfer_fn.config import ModelConfig
from deepinfer_fn.layer_groups import LayerStack
from deepinfer_fn.params import Params, abstract_tree, is_spec, param_specs

BATCH_AXES = ("dp", "ep")

# logical axis -> mesh axes (None = replicated). One table for params and decode state.
RULES: dict[str, Any] = {
    "batch": BATCH_AXES,
    "expert": "ep",
    "mlp": "tp",
    "q_heads": "tp",
    "o_groups": "tp",
    "index_heads": "tp",
    "vocab": None,
    "layers": None,          # the stacked axis of a scanned layer group
    "engram_rows": BATCH_AXES,   # V4.1 Engram tables (~197B values): rows over every device
}


def make_mesh(dp: int = 1, ep: int = 1, tp: int = 1, devices=None) -> Mesh:
    """A (dp, ep, tp) mesh over `devices` (default: all, across processes)."""
    devices = list(jax.devices() if devices is None else devices)
    n = dp * ep * tp
    if n != len(devices):
        raise ValueError(f"mesh dp={dp} x ep={ep} x tp={tp} = {n} devices, but {len(devices)} "
                         f"are available")
    return Mesh(np.asarray(devices).reshape(dp, ep, tp), ("dp", "ep", "tp"))


def batch_shards(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def logical_spec(axes, shape, mesh: Mesh, rules=RULES) -> P:
    """PartitionSpec for a tensor with logical `axes`; a dim that a mesh axis does not divide
    stays replicated along it (e.g. tiny test configs), never silently mis-sharded."""
    out = []
    for ax, dim in zip(axes, shape):
        target = rules.get(ax) if ax is not None else None
        if target is None:
            out.append(None)
            continue
        names = (target,) if isinstance(target, str) else tuple(target)
        names = tuple(a for a in names if mesh.shape.get(a, 1) > 1)
        size = math.prod(mesh.shape[a] for a in names)
        if not names or dim % size:
            out.append(None)
        else:
            out.append(names[0] if len(names) == 1 else names)
    return P(*out)


def _spec_at(specs, path):
    """The Spec at a params path, or None for leaves the description does not have
    (e.g. the replica tables `shardings.replicate_experts` adds)."""
    node = specs
    for key in path:
        if isinstance(key, jax.tree_util.GetAttrKey):          # LayerStack.blocks
            node = getattr(node, key.name, None)
            continue
        k = getattr(key, "key", getattr(key, "idx", None))
        try:
            node = node[k]
        except (KeyError, IndexError, TypeError):
            return None
    return node if is_spec(node) else None


def param_shardings(params: Params | ModelConfig, mesh: Mesh, rules=RULES):
    """NamedShardings for every weight, derived from the abstract description (`param_specs`).

    Given params, each leaf takes its spec's logical axes with the leaf's actual shape (so
    physical expert counts after `replicate_experts` work too; unknown leaves are replicated).
    Given a ModelConfig, the shardings of the described model (MTP included)."""
    if isinstance(params, ModelConfig):
        specs = param_specs(params, include_mtp=True)
        return jax.tree.map(lambda s: NamedSharding(mesh, logical_spec(s.axes, s.shape, mesh, rules)),
                            specs, is_leaf=is_spec)
    specs = param_specs(params.config, include_mtp=bool(params["mtp"]))

    def one(path, leaf):
        spec = _spec_at(specs, path)
        if spec is None or len(spec.axes) != leaf.ndim:
            return NamedSharding(mesh, P())
        return NamedSharding(mesh, logical_spec(spec.axes, leaf.shape, mesh, rules))

    return jax.tree_util.tree_map_with_path(one, params.weights)


def shard_params(params: Params, mesh: Mesh, rules=RULES) -> Params:
    """Places params on `mesh` (routed experts over ep, the rest replicated / tp-split)."""
    return Params(jax.device_put(params.weights, param_shardings(params, mesh, rules)),
                  params.config)


def mesh_of(params: Params) -> Mesh | None:
    """The mesh params were placed on (None for single-device / unsharded params)."""
    leaf = params["embed"]
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
        return sharding.mesh
    return None


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def state_shardings(state, mesh: Mesh):
    """Decode-state shardings: every array is split over the batch (its leading axis; axis 1
    on the stacked leaves of a scanned layer group, whose leading axis is the group's
    repeats)."""
    def split(tree, lead: int):
        return jax.tree.map(lambda x: NamedSharding(
            mesh, P(*([None] * lead), BATCH_AXES, *([None] * (x.ndim - 1 - lead)))), tree)

    layers = getattr(state, "layers", None)
    if not isinstance(layers, LayerStack):
        return split(state, 0)
    return dataclasses.replace(split(dataclasses.replace(state, layers=()), 0),
                               layers=layers.map_blocks(lambda scanned, t: split(t, int(scanned))))


def abstract_params(cfg: ModelConfig, dtype=jnp.float32, mesh: Mesh | None = None, *,
                    include_mtp: bool = True, rules=RULES) -> Params:
    """`Params` of `cfg` as `jax.ShapeDtypeStruct`s, nothing allocated (with their
    `param_shardings` when a mesh is given): lower / compile / study memory of any preset,
    e.g. `jax.jit(f).lower(abstract_params(v4flash), ...)`."""
    specs = param_specs(cfg, include_mtp)
    shardings = None if mesh is None else jax.tree.map(
        lambda s: NamedSharding(mesh, logical_spec(s.axes, s.shape, mesh, rules)), specs,
        is_leaf=is_spec)
    return Params(abstract_tree(specs, dtype, shardings), cfg)


# --- per-shard programs over the batch axes (the engine's slot and page pools) ---------------


def batch_axis_spec(axis: int) -> P:
    """PartitionSpec splitting dimension `axis` over the batch axes (the others whole)."""
    return P(*([None] * axis), BATCH_AXES)


def batch_split_shardings(axes, mesh: Mesh):
    """NamedShardings from a pytree of ints (each leaf's batch axis, split over dp x ep)."""
    return jax.tree.map(lambda a: NamedSharding(mesh, batch_axis_spec(a)), axes)


def trace_batch_shards() -> tuple[Any, int]:
    """(mesh, batch shards) of the mesh the current trace runs under (`jax.set_mesh`), or
    (None, 1) without one or when its batch axes have one shard."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or any(a not in mesh.shape for a in BATCH_AXES):
        return None, 1
    n = math.prod(mesh.shape[a] for a in BATCH_AXES)
    return (mesh, n) if n > 1 else (None, 1)


def per_batch_shard(fn, args: tuple, axes: tuple, out_axes):
    """fn(shard, *args) on every batch shard of the trace's mesh: `jax.shard_map` over the batch
    axes, each arg leaf split along its axis in `axes` (a pytree prefix of ints), the outputs
    along `out_axes`; shard = the shard's index over dp x ep (row-major, as P(("dp", "ep"))
    lays blocks out). Without a mesh (or with one shard): fn(0, *args) on the whole arrays."""
    mesh, n = trace_batch_shards()
    if n == 1:
        return fn(0, *args)
    to_specs = lambda tree: jax.tree.map(batch_axis_spec, tree)
    body = lambda *a: fn(jax.lax.axis_index(BATCH_AXES), *a)
    return jax.shard_map(body, mesh=mesh, in_specs=to_specs(axes), out_specs=to_specs(out_axes),
                         check_vma=False)(*args)
