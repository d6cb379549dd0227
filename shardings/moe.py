"""Expert-parallel MoE dispatch inside `shard_map` (the only explicit collectives of the model).

Each device holds a batch shard of tokens (attention is data parallel over dp x ep) and E/ep
experts. A device routes its own tokens, sends every (token, expert) assignment to the device
owning that expert over `ep`, runs its experts as one grouped GEMM through the kernel registry,
sends the results back, and combines them with the routing weights. Expert groups are
replicated over `dp`, so each dp slice runs its own EP exchange.

Two dispatches, one contract (== `routed_experts` on one device):

* "fixed": a fixed-capacity `all_to_all`. Each device sends an [ep, n*k, D] buffer (capacity =
  every assignment of the shard to every destination, so nothing is ever dropped): ep * n*k
  rows per device per exchange, whatever the routing. Runs everywhere (XLA:CPU included).
* "ragged": assignments sorted by destination, the per-(destination, local expert) counts
  exchanged with a small `all_to_all`, then `lax.ragged_all_to_all` moves exactly the n*k rows
  that exist; the combine is the reverse `ragged_all_to_all`. XLA:GPU and TPU implement it,
  XLA:CPU does not.
  Receive buffer: a static bound of `recv_capacity` rows per device. The default, ep * n*k
  (every device sends all its rows to one device), cannot overflow and equals the fixed
  path's receive buffer. A smaller bound saves memory; when any device of the mesh would
  receive more rows than it holds, the step runs the fixed dispatch instead (a `lax.cond` on a
  mesh-wide flag), so rows are never dropped.
* "ragged_emulated": the ragged path with `ragged_all_to_all_emulated` (the same offsets /
  sizes contract built from a dense `all_to_all` of padded blocks). It moves more bytes than
  either real path; it exists to test the ragged index arithmetic on CPU.

`resolve_dispatch` picks one in one place: the `dispatch` argument, else `use_dispatch(...)`,
else `$DEEPINFER_MOE_DISPATCH`, else "auto" (ragged on GPU / TPU, fixed on CPU), mirroring
how `deepinfer_fn.kernel_registry` picks kernels. The setting is read when a program is traced.
"""

from __future__ import annotations

import contextlib
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from deepinfer_fn import kernels
from deepinfer_fn.model.experts import routed_experts, unsort

BATCH = ("dp", "ep")
DISPATCHES = ("auto", "fixed", "ragged", "ragged_emulated")
RAGGED_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")   # backends with a ragged-all-to-all
_OVERRIDE: list[str] = []


# ------------------------------------------------------------------------- choosing a dispatch
def resolve_dispatch(dispatch: str | None = None, platform: str | None = None) -> str:
    """The dispatch a program traced now runs: "fixed", "ragged" or "ragged_emulated".

    `dispatch` None -> the innermost `use_dispatch`, else $DEEPINFER_MOE_DISPATCH, else "auto";
    `platform` None -> `jax.default_backend()` (pass "cuda" to build a GPU program elsewhere).
    """
    if dispatch is None:
        dispatch = (_OVERRIDE[-1] if _OVERRIDE
                    else os.environ.get("DEEPINFER_MOE_DISPATCH", "").strip() or "auto")
    if dispatch not in DISPATCHES:
        raise ValueError(f"MoE dispatch {dispatch!r} is not one of {DISPATCHES}")
    platform = (platform or jax.default_backend()).lower()
    ragged_ok = platform in RAGGED_PLATFORMS
    if dispatch == "auto":
        return "ragged" if ragged_ok else "fixed"
    if dispatch == "ragged" and not ragged_ok:
        raise ValueError(
            f"MoE dispatch 'ragged' needs lax.ragged_all_to_all, which the {platform!r} platform "
            f"does not implement (XLA:{platform.upper()}); supported on {RAGGED_PLATFORMS}. "
            f"Use 'fixed' or 'auto' there ('ragged_emulated' tests the ragged arithmetic).")
    return dispatch


def mesh_platform(mesh) -> str:
    """The platform of a mesh's devices (a Mesh or the AbstractMesh of a trace), else the
    default backend's."""
    abstract = getattr(mesh, "abstract_mesh", mesh)
    device = getattr(abstract, "abstract_device", None)
    return getattr(device, "platform", None) or jax.default_backend()


@contextlib.contextmanager
def use_dispatch(dispatch: str):
    """Programs traced inside the block use `dispatch` (one of DISPATCHES)."""
    if dispatch not in DISPATCHES:
        raise ValueError(f"MoE dispatch {dispatch!r} is not one of {DISPATCHES}")
    _OVERRIDE.append(dispatch)
    try:
        yield
    finally:
        _OVERRIDE.pop()


# ---------------------------------------------------------------------------- shared pieces
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
    h = kernels.grouped_swiglu(xs, w1, w3, sizes, limit=limit)
    ys = kernels.grouped_matmul(h, w2, sizes)
    return unsort(ys, order)


def _combine(per_slot, weights, dtype):
    """sum_k weights[n,k] * per_slot[n,k,:] in fp32, slot order: [N,k,D] -> [N,D]."""
    out = jnp.einsum("nk,nkd->nd", weights, per_slot.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    return out.astype(dtype)


def _exclusive_cumsum(sizes):
    return jnp.cumsum(sizes) - sizes


# ------------------------------------------------------------------------- fixed capacity
def _ep_fixed(x, idx, weights, w1, w3, w2, *, limit: float, ep: int):
    """One shard's fixed-capacity dispatch: x [n,D], idx/weights [n,k] -> [n,D]."""
    n, k = idx.shape
    d = x.shape[-1]
    n_local = w1.shape[0]
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
    return _combine(back[dest, pos].reshape(n, k, d), weights, x.dtype)


# ------------------------------------------------------------------------------- ragged
def ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
    """EMULATION of `lax.ragged_all_to_all` (same arguments, same result) for platforms without
    it: every slice is padded to operand's M rows and moved by a dense `all_to_all`
    (K*M rows per device, K = len(input_offsets)), then written where `output_offsets` says.
    Received rows that fall outside `output` are dropped (the real op leaves that undefined)."""
    m = operand.shape[0]
    n_slices = input_offsets.shape[0]
    rows = jnp.arange(m, dtype=jnp.int32)
    trailing = (1,) * (operand.ndim - 1)
    src = jnp.clip(input_offsets[:, None] + rows[None, :], 0, m - 1)           # [K, M]
    sent = (rows[None, :] < send_sizes[:, None]).reshape(n_slices, m, *trailing)
    blocks = jnp.where(sent, operand[src], jnp.zeros((), operand.dtype))        # [K, M, ...]
    recv_blocks = jax.lax.all_to_all(blocks, axis_name, 0, 0, tiled=True)
    dst_start = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # [K]
    dst = jnp.where(rows[None, :] < recv_sizes[:, None], dst_start[:, None] + rows[None, :],
                    output.shape[0])                                            # OOB -> dropped
    return output.at[dst.reshape(-1)].set(
        recv_blocks.reshape(n_slices * m, *operand.shape[1:]), mode="drop")


def ragged_plan(idx, n_local: int, ep: int):
    """A shard's assignments sorted by destination: idx [N,k] (global expert ids) ->
    (order [N*k] the sort, counts [ep, n_local] assignments per destination and local expert,
    send_sizes [ep], input_offsets [ep]). Row r of the send buffer is assignment order[r]."""
    flat_e = idx.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    counts = jnp.bincount(flat_e, length=ep * n_local).astype(jnp.int32).reshape(ep, n_local)
    send_sizes = counts.sum(1)
    return order, counts, send_sizes, _exclusive_cumsum(send_sizes)


def received_local_experts(recv_counts, n_rows: int):
    """Local expert of each received row: recv_counts [ep, n_local] (rows from sender s for
    local expert e, laid out sender-major then by expert) -> [n_rows] int32, -1 past the end."""
    n_local = recv_counts.shape[1]
    ends = jnp.cumsum(recv_counts.reshape(-1))
    r = jnp.arange(n_rows, dtype=jnp.int32)
    segment = jnp.searchsorted(ends, r, side="right").astype(jnp.int32)
    return jnp.where(r < ends[-1], segment % n_local, -1)


def _ep_ragged(x, idx, weights, w1, w3, w2, *, limit: float, ep: int, recv_rows: int,
               a2a):
    """One shard's ragged dispatch: x [n,D], idx/weights [n,k] -> [n,D]; `a2a` is
    lax.ragged_all_to_all or its emulation; recv_rows bounds the rows this device receives."""
    n, k = idx.shape
    d = x.shape[-1]
    n_local = w1.shape[0]
    order, counts, send_sizes, input_offsets = ragged_plan(idx, n_local, ep)
    send_x = x[order // k]                                                       # [N*k, D]
    # counts and this shard's send offsets to every destination, in one small exchange
    meta = jax.lax.all_to_all(jnp.concatenate([counts, input_offsets[:, None]], 1),
                              "ep", 0, 0, tiled=True)                            # [ep, n_local+1]
    recv_counts, sender_offsets = meta[:, :n_local], meta[:, n_local]
    recv_sizes = recv_counts.sum(1)
    recv_offsets = _exclusive_cumsum(recv_sizes)          # sender s's block in my receive buffer
    output_offsets = jax.lax.all_to_all(recv_offsets, "ep", 0, 0, tiled=True)  # mine on each dest
    recv_x = a2a(send_x, jnp.zeros((recv_rows, d), x.dtype), input_offsets, send_sizes,
                 output_offsets, recv_sizes, axis_name="ep")
    y = _local_expert_compute(recv_x, received_local_experts(recv_counts, recv_rows),
                              w1, w3, w2, limit)
    back = a2a(y, jnp.zeros((n * k, d), y.dtype), recv_offsets, recv_sizes, sender_offsets,
               send_sizes, axis_name="ep")                                       # sorted order
    per_slot = unsort(back, order).reshape(n, k, d)
    return _combine(per_slot, weights, x.dtype)


def _ep_ragged_bounded(x, idx, weights, w1, w3, w2, *, limit: float, ep: int, recv_rows: int,
                       a2a):
    """The ragged dispatch with a receive buffer smaller than the worst case: if any device
    of the mesh would receive more than recv_rows rows, the whole step runs the fixed path."""
    n_local = w1.shape[0]
    counts = jnp.bincount(idx.reshape(-1), length=ep * n_local).reshape(ep, n_local).sum(1)
    mine = jax.lax.psum(counts, "ep")[jax.lax.axis_index("ep")]      # rows I would receive
    overflow = jax.lax.pmax((mine > recv_rows).astype(jnp.int32), BATCH) > 0
    args = (x, idx, weights, w1, w3, w2)
    return jax.lax.cond(
        overflow, lambda *a: _ep_fixed(*a, limit=limit, ep=ep),
        lambda *a: _ep_ragged(*a, limit=limit, ep=ep, recv_rows=recv_rows, a2a=a2a), *args)


def _ep_local(x, idx, weights, w1, w3, w2, *, limit: float, ep: int, dispatch: str,
              recv_capacity: int | None):
    if ep == 1:
        return routed_experts({"w1": w1, "w3": w3, "w2": w2}, x, idx, weights, limit)
    if dispatch == "fixed":
        return _ep_fixed(x, idx, weights, w1, w3, w2, limit=limit, ep=ep)
    a2a = jax.lax.ragged_all_to_all if dispatch == "ragged" else ragged_all_to_all_emulated
    worst = ep * idx.size
    if recv_capacity is None or recv_capacity >= worst:
        return _ep_ragged(x, idx, weights, w1, w3, w2, limit=limit, ep=ep, recv_rows=worst,
                          a2a=a2a)
    return _ep_ragged_bounded(x, idx, weights, w1, w3, w2, limit=limit, ep=ep,
                              recv_rows=recv_capacity, a2a=a2a)


def ep_routed_experts(p, x, idx, weights, limit: float, mesh, *, dispatch: str | None = None,
                      platform: str | None = None, recv_capacity: int | None = None):
    """Routed experts with tokens split over dp x ep and experts over ep.

    x [N,D] (N divisible by dp*ep), idx/weights [N,k] (physical expert ids), p["w1"/"w3"/"w2"]
    [E,...] with E divisible by ep. Equal to `routed_experts` on one device. `dispatch`,
    `platform` (default: the mesh's devices'): see `resolve_dispatch`. `recv_capacity`: the
    ragged receive buffer in rows per device (default ep * (N/(dp*ep)) * k, which cannot
    overflow; with a smaller one a step that would overflow runs the fixed dispatch).
    """
    ep = mesh.shape["ep"]
    if p["w1"].shape[0] % ep:
        raise ValueError(f"{p['w1'].shape[0]} experts cannot be split over ep={ep}")
    if recv_capacity is not None and (not isinstance(recv_capacity, int) or recv_capacity < 1):
        raise ValueError(f"recv_capacity must be a positive int of rows, got {recv_capacity!r}")
    chosen = resolve_dispatch(dispatch, platform or mesh_platform(mesh))
    fn = jax.shard_map(
        lambda *a: _ep_local(*a, limit=limit, ep=ep, dispatch=chosen,
                             recv_capacity=recv_capacity), mesh=mesh,
        in_specs=(P(BATCH, None), P(BATCH, None), P(BATCH, None),
                  P("ep", None, None), P("ep", None, None), P("ep", None, None)),
        out_specs=P(BATCH, None), check_vma=False)
    return fn(x, idx, weights, p["w1"], p["w3"], p["w2"])


# ------------------------------------------------------------------------- bytes per step
def dispatch_rows(idx, n_experts: int, dp: int, ep: int) -> dict[str, np.ndarray]:
    """Rows each device sends in one dispatch (the combine sends as many back), per path.

    idx [N,k] global (physical) expert ids of the whole batch, split over dp x ep as the mesh
    splits it (device d = dp index * ep + ep index holds tokens [d*n, (d+1)*n)). Returns int
    arrays [dp*ep]: "fixed" (ep * n*k, whatever the routing), "fixed_remote" ((ep-1) * n*k),
    "ragged" (n*k: each assignment once), "ragged_remote" (those owned by another device) and
    "ragged_received" (rows each device receives: the hot spot of a skewed routing).
    """
    idx = np.asarray(idx)
    n_total, k = idx.shape
    if n_total % (dp * ep) or n_experts % ep:
        raise ValueError(f"{n_total} tokens / {n_experts} experts do not split over "
                         f"dp={dp} x ep={ep}")
    n = n_total // (dp * ep)
    dest = (idx // (n_experts // ep)).reshape(dp, ep, n * k)        # owner's ep index
    received = np.stack([(dest == j).sum(axis=(1, 2)) for j in range(ep)], axis=1)  # [dp, ep]
    full = np.full(dp * ep, n * k, np.int64)
    return {"fixed": ep * full, "fixed_remote": (ep - 1) * full, "ragged": full,
            "ragged_remote": (dest != np.arange(ep)[None, :, None]).sum(-1).reshape(-1),
            "ragged_received": received.reshape(-1)}


def dispatch_bytes(idx, n_experts: int, dp: int, ep: int, hidden: int,
                   itemsize: int = 2) -> dict[str, np.ndarray]:
    """Bytes each device sends per MoE layer (dispatch + combine + index exchanges), per path:
    "fixed" = ep*n*k rows each way plus their int32 expert ids; "ragged" = the n*k rows each
    way plus the int32 counts / offsets (ep * (E/ep + 1) and ep values); "*_remote" = the part
    that leaves the device. Arrays [dp*ep]; `itemsize` = bytes per activation value."""
    rows = dispatch_rows(idx, n_experts, dp, ep)
    row_b = hidden * itemsize
    meta = 4 * (ep * (n_experts // ep + 1) + ep)
    return {"fixed": rows["fixed"] * (2 * row_b + 4),
            "fixed_remote": rows["fixed_remote"] * (2 * row_b + 4),
            "ragged": rows["ragged"] * 2 * row_b + meta,
            "ragged_remote": rows["ragged_remote"] * 2 * row_b + meta * (ep - 1) // ep}
