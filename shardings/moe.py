"""Expert-parallel MoE dispatch inside `shard_map` (the only explicit collectives of the model).

Each device holds a batch shard of tokens (attention is data parallel over dp x ep) and E/ep
experts. A device routes its own tokens, sends every (token, expert) assignment to the device
owning that expert with an all-to-all over `ep`, runs its experts as one grouped GEMM through
the kernel registry, sends the results back with a second all-to-all, and combines them with
the routing weights. Expert groups are replicated over `dp`, so each dp slice runs its own EP
exchange.

CPU path: fixed-capacity `all_to_all` (capacity = every assignment of the shard, so no token is
ever dropped). Where `ragged_all_to_all` is supported (GPU), only the rows that exist move; see
`dispatch="ragged"`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from deepinfer_fn import kernels
from deepinfer_fn.model.experts import routed_experts, swiglu

BATCH = ("dp", "ep")


def _rank_within_group(group, n_groups):
    """For each element, how many earlier elements share its group: [C] -> [C]."""
    onehot = jax.nn.one_hot(group, n_groups, dtype=jnp.int32)
    return jnp.take_along_axis(jnp.cumsum(onehot, axis=0) - 1, group[:, None], axis=1)[:, 0]


def _local_expert_compute(rows, local_expert, w1, w3, w2, limit):
    """Grouped GEMMs over received rows: rows [R,D], local_expert [R] (-1 = empty slot)."""
    n_local = w1.shape[0]
    key = jnp.where(local_expert < 0, n_local, local_expert)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=n_local + 1)[:n_local].astype(jnp.int32)
    xs = rows[order]
    h = swiglu(kernels.grouped_matmul(xs, w1, sizes), kernels.grouped_matmul(xs, w3, sizes), limit)
    ys = kernels.grouped_matmul(h, w2, sizes)
    return jnp.zeros_like(ys).at[order].set(ys)


def _ep_local(x, idx, weights, w1, w3, w2, *, limit: float, ep: int):
    n, k = idx.shape
    d = x.shape[-1]
    n_local = w1.shape[0]
    if ep == 1:
        return routed_experts({"w1": w1, "w3": w3, "w2": w2}, x, idx, weights, limit)
    flat_e = idx.reshape(-1)
    dest = flat_e // n_local
    pos = _rank_within_group(dest, ep)
    cap = n * k
    token = jnp.arange(cap) // k
    send_x = jnp.zeros((ep, cap, d), x.dtype).at[dest, pos].set(x[token])
    send_e = jnp.full((ep, cap), -1, jnp.int32).at[dest, pos].set(flat_e % n_local)
    recv_x = jax.lax.all_to_all(send_x, "ep", 0, 0, tiled=True)
    recv_e = jax.lax.all_to_all(send_e, "ep", 0, 0, tiled=True)
    y = _local_expert_compute(recv_x.reshape(ep * cap, d), recv_e.reshape(-1), w1, w3, w2, limit)
    back = jax.lax.all_to_all(y.reshape(ep, cap, d), "ep", 0, 0, tiled=True)
    per_slot = back[dest, pos].reshape(n, k, d)
    out = jnp.einsum("nk,nkd->nd", weights, per_slot.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    return out.astype(x.dtype)


def ep_routed_experts(p, x, idx, weights, limit: float, mesh):
    """Routed experts with tokens split over dp x ep and experts over ep.

    x [N,D] (N divisible by dp*ep), idx/weights [N,k] (physical expert ids), p["w1"/"w3"/"w2"]
    [E,...] with E divisible by ep. Equal to `routed_experts` on one device.
    """
    ep = mesh.shape["ep"]
    if p["w1"].shape[0] % ep:
        raise ValueError(f"{p['w1'].shape[0]} experts cannot be split over ep={ep}")
    fn = jax.shard_map(
        lambda *a: _ep_local(*a, limit=limit, ep=ep), mesh=mesh,
        in_specs=(P(BATCH, None), P(BATCH, None), P(BATCH, None),
                  P("ep", None, None), P("ep", None, None), P("ep", None, None)),
        out_specs=P(BATCH, None), check_vma=False)
    return fn(x, idx, weights, p["w1"], p["w3"], p["w2"])
