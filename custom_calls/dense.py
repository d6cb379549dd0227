"""Dense projections of the few rows of a decode step on Hopper, in Pallas Mosaic GPU
(`linear` / `grouped_linear`, `mosaic_gpu`): a split-K weight-streaming GEMM.

At decode every projection has M <= 64 activation rows (the batch): it is weight streaming.
XLA serves it with a Triton GEMM, and inside a scanned layer group it first copies the
layer's weight out of the stacked array (a dynamic slice the GEMM fusion does not absorb),
so the weight crosses HBM three times; a custom call takes the dynamic slice as an address
offset instead (XLA's dynamic-slice fusion).

Kernel: G independent products y[g] = x[g] @ w[g] (x [G, M, K], w [G, K, N]; `linear` is
G = 1, `grouped_linear` the wo_a groups). The weight is cut into items of block_n columns x
K / splits rows; one CTA an item streams its slab through a TMA + wgmma pipeline (x rows
past M read as zeros: the copy engine fills them) and writes its fp32 partial product
[M, block_n] to out[g, split]. Splits are chosen so that the items fill the GPU's SMs;
XLA adds the partials (a reduction it fuses into the consumer) and casts to w's dtype.

Taken (`prefers`) for M <= MAX_ROWS with bf16 / fp16 weights whose K and N are multiples
of 64; everything else is the XLA reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from custom_calls._common import lowered_once, on_hopper, round_up
from deepinfer_fn.model.common import grouped_linear_xla, linear, linear_xla

MAX_ROWS = 64      # decode batches; more rows are a GEMM XLA serves at the matmul peak
NUM_SMS = 132      # H100 SXM / H200
_TILE = 64


def plan(g: int, k: int, n: int | tuple[int, ...], num_sms: int = NUM_SMS) -> dict:
    """Tiles and K splits for weights of n columns (one int, or the widths of several weights
    read in one launch): block_n 128 when every width allows it and that still gives a wave
    of items, else 64; K split in halves while the items fill fewer than two waves and each
    keeps >= 2 K steps."""
    widths = (n,) if isinstance(n, int) else tuple(n)
    block_k = _TILE
    wide = all(w % 128 == 0 for w in widths) and g * sum(w // 128 for w in widths) >= num_sms // 2
    block_n = 128 if wide else _TILE
    tiles = g * sum(w // block_n for w in widths)
    k_steps = k // block_k
    splits = 1
    while (tiles * splits < 2 * num_sms and k_steps % (2 * splits) == 0
           and k_steps // (2 * splits) >= 2):
        splits *= 2
    return dict(block_n=block_n, block_k=block_k, splits=splits,
                stages=max(2, min(4, k_steps // splits)))


def _skinny_pallas(x, *ws, block_n, block_k, splits, stages):
    """x [G, Mp, K], ws[j] [G, K, N_j] -> fp32 partials, one [G, splits * Mp, N_j] per weight.

    Items (one CTA each) run over the weights in order, then groups, column tiles, K splits;
    with several weights an item branches to its weight's pipeline (all read the same x)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    g, mp, k = x.shape
    n_tiles = [w.shape[2] // block_n for w in ws]
    k_per_split = k // block_k // splits
    first = [0]
    for nt in n_tiles:
        first.append(first[-1] + g * nt * splits)
    block_m = 64                          # wgmma rows; x rows past Mp read as zeros

    def item(j, rel, x_gmem, w_gmem, o_gmem):
        gi = rel // (n_tiles[j] * splits)
        rest = rel % (n_tiles[j] * splits)
        ni = rest // splits
        si = rest % splits
        k0 = si * k_per_split

        def acc_scope(acc_ref):
            plgpu.emit_pipeline(
                lambda _, x_smem, w_smem: plgpu.wgmma(acc_ref, x_smem, w_smem),
                grid=(k_per_split,),
                in_specs=[
                    plgpu.BlockSpec((block_m, block_k), lambda kk: (0, k0 + kk),
                                    delay_release=1),
                    plgpu.BlockSpec((block_k, block_n), lambda kk: (k0 + kk, ni),
                                    delay_release=1),
                ],
                max_concurrent_steps=stages,
            )(x_gmem.at[gi], w_gmem.at[gi])
            return acc_ref[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC((block_m, block_n)))

        @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((block_m, block_n), jnp.float32))
        def _store(o_smem):
            o_smem[...] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, mp)],
                                    o_gmem.at[gi, pl.ds(si * mp, mp), pl.ds(ni * block_n, block_n)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def decode_gemm(x_gmem, *refs):
        w_refs, o_refs = refs[:len(ws)], refs[len(ws):]
        i = jax.lax.axis_index("i")
        if len(ws) == 1:
            item(0, i, x_gmem, w_refs[0], o_refs[0])
            return
        for j in range(len(ws)):
            pl.when((i >= first[j]) & (i < first[j + 1]))(
                functools.partial(item, j, i - first[j], x_gmem, w_refs[j], o_refs[j]))

    if len(ws) > 1:     # the kernel's name in profiles says how many weights a launch streams
        decode_gemm.__name__ = f"decode_gemm_x{len(ws)}"
    kernel = plgpu.kernel(
        decode_gemm,
        out_type=tuple(jax.ShapeDtypeStruct((g, splits * mp, w.shape[2]), jnp.float32)
                       for w in ws),
        grid=(first[-1],),
        grid_names=("i",),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return kernel(x, *ws)


_skinny_kernel = lowered_once(_skinny_pallas, "block_n", "block_k", "splits", "stages")


def _rows_for_tma(x, dtype):
    """x [G, M, K] in `dtype`, rows padded to the tiled TMA layout (<= 8 or a multiple of 8)."""
    m = x.shape[1]
    mp = m if m <= 8 else round_up(m, 8)
    xx = x.astype(dtype)
    return jnp.pad(xx, ((0, 0), (0, mp - m), (0, 0))) if mp != m else xx


def _sum_partials(parts, splits: int, m: int, dtype):
    """fp32 partials [G, splits * Mp, N] -> [G, m, N] in dtype."""
    g, rows, n = parts.shape
    return parts.reshape(g, splits, rows // splits, n).sum(axis=1)[:, :m].astype(dtype)


def skinny_matmul(x, w, *, interpret: bool = False, **override):
    """x [G, M, K] @ w [G, K, N] -> [G, M, N] in w's dtype (fp32 accumulation), M <= 64."""
    g, m, k = x.shape
    cfg = plan(g, k, w.shape[2], num_sms=4 if interpret else NUM_SMS)
    cfg.update(override)
    parts, = _skinny_kernel(_rows_for_tma(x, w.dtype), w, interpret=interpret, **cfg)
    return _sum_partials(parts, cfg["splits"], m, w.dtype)


def skinny_matmul_many(x, ws, *, interpret: bool = False, **override):
    """x [M, K] @ ws[j] [K, N_j] -> tuple of [M, N_j] (each in its weight's dtype, one dtype
    for all), M <= 64: every weight streamed by one kernel launch."""
    m, k = x.shape
    dtype = ws[0].dtype
    assert all(w.dtype == dtype and w.shape[0] == k for w in ws), [(w.shape, w.dtype) for w in ws]
    cfg = plan(1, k, tuple(w.shape[1] for w in ws), num_sms=4 if interpret else NUM_SMS)
    cfg.update(override)
    parts = _skinny_kernel(_rows_for_tma(x[None], dtype), *(w[None] for w in ws),
                           interpret=interpret, **cfg)
    return tuple(_sum_partials(pt, cfg["splits"], m, dtype)[0] for pt in parts)


def _fits(m: int, k: int, n: int, dtype) -> bool:
    return (m <= MAX_ROWS and k % _TILE == 0 and n % _TILE == 0
            and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)))


def linear_prefers(x, w) -> bool:
    """Whether the platform preference takes the kernel for x [M, K] @ w [K, N]."""
    return _fits(x.shape[0], *w.shape, w.dtype)


def grouped_linear_prefers(x, w) -> bool:
    """Whether the platform preference takes the kernel for x [M, G, I], w [G, I, R]."""
    return _fits(x.shape[0], *w.shape[1:], w.dtype)


def linear_mgpu(x, w, *, interpret: bool = False, **override):
    """Registry signature (`kernels.linear`): x [M, K], w [K, N] -> [M, N] in w's dtype."""
    if not _fits(x.shape[0], *w.shape, w.dtype):
        return linear_xla(x, w)
    return skinny_matmul(x[None], w[None], interpret=interpret, **override)[0]


def grouped_linear_mgpu(x, w, *, interpret: bool = False, **override):
    """Registry signature (`kernels.grouped_linear`): x [M, G, I], w [G, I, R] -> [M, G, R]."""
    if not _fits(x.shape[0], *w.shape[1:], w.dtype):
        return grouped_linear_xla(x, w)
    y = skinny_matmul(jnp.swapaxes(x, 0, 1), w, interpret=interpret, **override)
    return jnp.swapaxes(y, 0, 1)


def _kernel_share(x, ws) -> list[int]:
    """Indices of the weights of `ws` one launch streams for x [M, K]: those the kernel
    fits, of the first such weight's dtype."""
    fit = [j for j, w in enumerate(ws) if _fits(x.shape[0], *w.shape, w.dtype)]
    return [j for j in fit if ws[j].dtype == ws[fit[0]].dtype] if fit else []


def linear_many_prefers(x, ws) -> bool:
    """Whether the platform preference takes one launch for x [M, K] @ each of ws: at least
    two of them fit the kernel."""
    return len(_kernel_share(x, ws)) >= 2


def linear_many_mgpu(x, ws, *, interpret: bool = False, **override):
    """Registry signature (`kernels.linear_many`): x [M, K], ws[j] [K, N_j] -> tuple of
    [M, N_j]. The weights the kernel fits go through one launch; any other through `linear`."""
    share = _kernel_share(x, ws)
    ys = [None] * len(ws)
    if share:
        for j, y in zip(share, skinny_matmul_many(x, [ws[j] for j in share],
                                                  interpret=interpret, **override)):
            ys[j] = y
    return tuple(linear(x, w) if y is None else y for y, w in zip(ys, ws))


linear_mgpu.available = grouped_linear_mgpu.available = linear_many_mgpu.available = on_hopper
linear_many_mgpu.prefers = linear_many_prefers
linear_mgpu.prefers = linear_prefers
grouped_linear_mgpu.prefers = grouped_linear_prefers
