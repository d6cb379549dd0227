"""MoE grouped GEMM for Hopper in Pallas Mosaic GPU (registered as `grouped_matmul`/`mosaic_gpu`).

    y[M, N] = x[M, K] @ w[g(row), K, N],  rows sorted by group, group_sizes [G] int32.

The ideas are those of JAX's shipped `pallas/ops/gpu/ragged_dot_mgpu.py` (a persistent
grid over the SMs, a TMA + wgmma pipeline over K per output tile, a logarithmic ladder of
TMA stores so that a tile writes only the rows of its own group), with two changes that
matter for MoE decode and for the registry's contract:

* the work list is computed outside the kernel, in XLA, from `group_sizes`: one work item
  per (row block, group) pair that holds rows of that group. Empty groups cost nothing
  (the shipped kernel spends a full tile, streaming that expert's weights, on an empty
  group whose start is not block-aligned: at decode that is almost all 64 experts);
* rows past sum(group_sizes) are written with zeros (one extra work item per row block of
  the tail), so the output never holds uninitialised memory.

Operands must be bf16 or fp16 (the wgmma input types); fp32 inputs are served by the XLA
reference (`grouped_matmul_mgpu` falls back to it). Accumulation is fp32; the output has w's
dtype. K and N are padded to the tile sizes only
when they are not multiples (that pads w, a full copy of the weights: avoid such shapes).
M is padded at most to a multiple of 8: the copy engine zero-fills the rows of the last
block past M.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from custom_calls._common import lowered_once, on_hopper, round_up
from deepinfer_fn import kernels_xla

NUM_SMS = 132  # H100 SXM / H200: the persistent grid size
LOG2E = math.log2(math.e)


def _work_list(group_sizes, m_rows: int, block_m: int):
    """Static-size work list for the kernel, computed in XLA (two or three small fusions).

    Returns meta int32 [4, T] (group id, row block, first row, end row within the block; a
    group id of G means "write zeros") and n_items int32 [1]. Items past n_items are unused.
    Group G (a pseudo group) covers the tail rows [sum(group_sizes), m_rows).
    """
    m_pad = m_rows
    g = group_sizes.shape[0]
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), m_pad)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    total = ends[-1]
    starts = jnp.concatenate([starts, total[None]])
    ends = jnp.concatenate([ends, jnp.full((1,), m_pad, jnp.int32)])
    nonempty = ends > starts
    first_blk = starts // block_m
    last_blk = jnp.maximum(ends - 1, 0) // block_m
    ntiles = jnp.where(nonempty, last_blk - first_blk + 1, 0)
    tiles_end = jnp.cumsum(ntiles)
    n_items = tiles_end[-1]
    t_max = -(-m_pad // block_m) + g  # each group adds at most one partial block
    t = jnp.arange(t_max, dtype=jnp.int32)
    # Group of each item: how many groups' tile ranges end at or before it (one fusion on
    # GPU, unlike searchsorted's default sequential loop).
    grp = jnp.sum(tiles_end[None, :] <= t[:, None], axis=1, dtype=jnp.int32)
    grp_c = jnp.minimum(grp, g)
    blk = first_blk[grp_c] + (t - (tiles_end[grp_c] - ntiles[grp_c]))
    lo = jnp.maximum(starts[grp_c], blk * block_m) - blk * block_m
    hi = jnp.minimum(ends[grp_c], blk * block_m + block_m) - blk * block_m
    valid = t < n_items
    meta = jnp.stack([jnp.where(valid, grp_c, g), jnp.where(valid, blk, 0),
                      jnp.where(valid, lo, 0), jnp.where(valid, hi, 0)]).astype(jnp.int32)
    return meta, n_items.reshape(1).astype(jnp.int32)


def _store_rows(o_smem, o_gmem, row0, lo, hi, col0, block_m: int, block_n: int):
    """Copy rows [lo, hi) of o_smem to o_gmem rows [row0 + lo, row0 + hi), cols [col0, +bn).

    TMA boxes have static shapes, so the dynamic row count is written as a sum of powers
    of two (at most log2(block_m) + 1 copies), largest first.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    count = hi - lo
    start = lo
    p = 1 << int(math.log2(min(block_m, o_gmem.shape[0])))  # count <= min(block_m, M)
    while p >= 1:
        @pl.when((count & p) != 0)
        def _(p=p, start=start):
            plgpu.copy_smem_to_gmem(
                o_smem.at[pl.ds(start, p)],
                o_gmem.at[pl.ds(row0 + start, p), pl.ds(col0, block_n)])
        start = start + (count & p)
        p //= 2
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _grouped_matmul_pallas(x, *ws_meta, block_m, block_n, block_k, max_concurrent_steps,
                           num_sms=NUM_SMS, swiglu_limit=None):
    """ws_meta = (w, meta, n_items), or (w1, w3, meta, n_items) with `swiglu_limit`: the
    output tile is swiglu(x @ w1, x @ w3) (each product rounded to w's dtype first, as the
    unfused ops round it), from two accumulators that share the x tiles."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    ws, (meta, n_items) = ws_meta[:-2], ws_meta[-2:]
    assert len(ws) == (1 if swiglu_limit is None else 2)
    w = ws[0]
    m, k = x.shape
    g, _, n = w.shape
    grid_n = n // block_n
    k_steps = k // block_k
    steps = max(2, min(max_concurrent_steps, k_steps))

    def epilogue(accs):
        if swiglu_limit is None:
            return accs[0]
        gate, up = (a.astype(w.dtype).astype(jnp.float32) for a in accs)
        gate = jnp.minimum(gate, swiglu_limit)
        up = jnp.minimum(jnp.maximum(up, -swiglu_limit), swiglu_limit)
        return gate / (1.0 + jnp.exp2(gate * -LOG2E)) * up     # silu(gate) * up

    def grouped_gemm(meta_gmem, count_gmem, x_gmem, *refs):
        w_gmems, o_gmem = refs[:-1], refs[-1]
        n_work = count_gmem[0] * grid_n

        @plgpu.nd_loop((n_work,), collective_axes="sm")
        def _work(info: plgpu.NDLoopInfo):
            idx = info.index[0]
            item = lax.div(idx, jnp.int32(grid_n))
            ni = lax.rem(idx, jnp.int32(grid_n))
            grp = meta_gmem[0, item]
            blk = meta_gmem[1, item]
            lo = meta_gmem[2, item]
            hi = meta_gmem[3, item]

            @pl.when(grp < g)
            def _matmul():
                def acc_scope(*acc_refs):
                    def body(_, x_smem, *w_smems):
                        for acc_ref, w_smem in zip(acc_refs, w_smems):
                            plgpu.wgmma(acc_ref, x_smem, w_smem)
                    w_spec = plgpu.BlockSpec((block_k, block_n), lambda kk: (kk, ni),
                                             delay_release=1)
                    plgpu.emit_pipeline(
                        body,
                        grid=(k_steps,),
                        in_specs=[plgpu.BlockSpec((block_m, block_k), lambda kk: (blk, kk),
                                                  delay_release=1)] + [w_spec] * len(ws),
                        max_concurrent_steps=steps,
                    )(x_gmem, *(w_gmem.at[grp] for w_gmem in w_gmems))
                    return tuple(acc_ref[...] for acc_ref in acc_refs)

                out = epilogue(pl.run_scoped(acc_scope,
                                             *[plgpu.ACC((block_m, block_n))] * len(ws)))

                @functools.partial(pl.run_scoped,
                                   o_smem=plgpu.SMEM((block_m, block_n), o_gmem.dtype))
                def _store(o_smem):
                    o_smem[...] = out.astype(o_smem.dtype)
                    plgpu.commit_smem()
                    _store_rows(o_smem, o_gmem, blk * block_m, lo, hi, ni * block_n,
                                block_m, block_n)

            @pl.when(grp >= g)
            def _zeros():
                @functools.partial(pl.run_scoped,
                                   o_smem=plgpu.SMEM((block_m, block_n), o_gmem.dtype))
                def _store(o_smem):
                    o_smem[...] = jnp.zeros((block_m, block_n), o_smem.dtype)
                    plgpu.commit_smem()
                    _store_rows(o_smem, o_gmem, blk * block_m, lo, hi, ni * block_n,
                                block_m, block_n)

    if swiglu_limit is not None:    # the kernel's name in profiles
        grouped_gemm.__name__ = "grouped_swiglu"
    kernel = plgpu.kernel(
        grouped_gemm,
        out_type=jax.ShapeDtypeStruct((m, n), w.dtype),
        grid=(num_sms,),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return kernel(meta, n_items, x, *ws)


_grouped_matmul_kernel = lowered_once(_grouped_matmul_pallas, "block_m", "block_n", "block_k",
                                      "max_concurrent_steps", "num_sms", "swiglu_limit")


def default_blocks(m: int, k: int, n: int, g: int) -> dict:
    """Tile sizes by regime (measured on an H200, benchmarks/results/kernels_h200.json).

    Decode (M <= 1024, few rows a group) is weight streaming: 64 x 128 tiles, unless that
    gives fewer work items than half the SMs (e.g. one token, N = 512: 6 experts x 4 column
    tiles), then 64-wide column tiles and a deeper pipeline so more SMs pull weights.
    Prefill: 128 x 128 tiles, 4 stages."""
    del k
    if m <= 1024:
        items = -(-n // 128) * min(g, m)
        if items < NUM_SMS // 2 or n <= 64:
            return dict(block_m=64, block_n=64, block_k=64, max_concurrent_steps=6)
        return dict(block_m=64, block_n=128, block_k=64, max_concurrent_steps=4)
    return dict(block_m=128, block_n=128 if n > 64 else 64, block_k=64, max_concurrent_steps=4)


def grouped_matmul_mgpu(x, w, group_sizes, *, interpret: bool = False, pad_m: bool = False,
                        **blocks):
    """Registry signature: x [M,K] (rows sorted by group), w [G,K,N], group_sizes [G] -> [M,N].

    M need not be a multiple of the row block: the last block's TMA loads read past M
    (the copy engine fills zeros) and the stores never write past M; M is only rounded up
    to a multiple of 8 (when > 8). `pad_m=True` pads x to the row block instead (an extra
    copy of the activations; kept for comparison)."""
    if w.dtype not in (jnp.bfloat16, jnp.float16):
        return kernels_xla.grouped_matmul(x, w, group_sizes)
    return _launch(x, (w,), group_sizes, None, interpret, pad_m, blocks)


def grouped_swiglu_mgpu(x, w1, w3, group_sizes, *, limit: float, interpret: bool = False,
                        **blocks):
    """Registry signature of `grouped_swiglu`: swiglu(x @ w1[g], x @ w3[g]) [M, N] in one
    kernel (two accumulators on the same x tiles; the gate and up products never leave the
    SM). Tiles as `default_blocks`, with 64-wide columns where the rows are 128 (two
    accumulators fit the registers of one)."""
    if w1.dtype not in (jnp.bfloat16, jnp.float16) or w3.dtype != w1.dtype \
            or w3.shape != w1.shape:
        return kernels_xla.grouped_swiglu(x, w1, w3, group_sizes, limit=limit)
    return _launch(x, (w1, w3), group_sizes, float(limit), interpret, False, blocks)


def _launch(x, ws, group_sizes, swiglu_limit, interpret: bool, pad_m: bool, blocks: dict):
    """Pads x and the weights to the tiles, builds the work list and runs the kernel."""
    m, k = x.shape
    g, k2, n = ws[0].shape
    if k != k2 or group_sizes.shape != (g,):
        raise ValueError(f"grouped_matmul: shapes x{x.shape} w{ws[0].shape} "
                         f"group_sizes{group_sizes.shape}")
    cfg = default_blocks(m, k, n, g)
    if swiglu_limit is not None and cfg["block_m"] > 64:
        cfg["block_n"] = 64
    cfg.update(blocks)
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    # TMA on the tiled layout wants M <= 8 or a multiple of 8: pad (a few rows) only then.
    mp = round_up(max(m, 1), bm) if pad_m else (round_up(m, 8) if m > 8 else m)
    kp, np_ = round_up(k, bk), round_up(n, bn)
    dtype = ws[0].dtype
    xx = x.astype(dtype)
    if (mp, kp) != (m, k):
        xx = jnp.pad(xx, ((0, mp - m), (0, kp - k)))
    if (kp, np_) != (k, n):
        ws = tuple(jnp.pad(w, ((0, 0), (0, kp - k), (0, np_ - n))) for w in ws)
    meta, n_items = _work_list(group_sizes, mp, bm)
    y = _grouped_matmul_kernel(xx, *ws, meta, n_items, block_m=bm, block_n=bn, block_k=bk,
                               max_concurrent_steps=cfg["max_concurrent_steps"],
                               num_sms=cfg.get("num_sms", 4 if interpret else NUM_SMS),
                               swiglu_limit=swiglu_limit, interpret=interpret)
    if (mp, np_) != (m, n):
        y = y[:m, :n]
    return y


grouped_matmul_mgpu.available = on_hopper
grouped_swiglu_mgpu.available = on_hopper
