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
from deepinfer_fn.model.common import grouped_linear_xla, linear_xla

MAX_ROWS = 64      # decode batches; more rows are a GEMM XLA serves at the matmul peak
NUM_SMS = 132      # H100 SXM / H200
_TILE = 64


def plan(g: int, k: int, n: int, num_sms: int = NUM_SMS) -> dict:
    """Tiles and K splits: block_n 128 when that still gives a wave of items, else 64; K split
    in halves while the items fill fewer than two waves and each keeps >= 2 K steps."""
    block_k = _TILE
    block_n = 128 if n % 128 == 0 and g * (n // 128) >= num_sms // 2 else _TILE
    k_steps = k // block_k
    splits = 1
    while (g * (n // block_n) * splits < 2 * num_sms and k_steps % (2 * splits) == 0
           and k_steps // (2 * splits) >= 2):
        splits *= 2
    return dict(block_n=block_n, block_k=block_k, splits=splits,
                stages=max(2, min(4, k_steps // splits)))


def _skinny_pallas(x, w, *, block_n, block_k, splits, stages):
    """x [G, Mp, K], w [G, K, N] -> fp32 partials [G, splits * Mp, N]."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    g, mp, k = x.shape
    n = w.shape[2]
    block_m = 64                          # wgmma rows; x rows past Mp read as zeros
    n_tiles = n // block_n
    k_per_split = k // block_k // splits
    items = g * n_tiles * splits

    def body(x_gmem, w_gmem, o_gmem):
        i = jax.lax.axis_index("i")
        gi = i // (n_tiles * splits)
        rest = i % (n_tiles * splits)
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

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((g, splits * mp, n), jnp.float32),
        grid=(items,),
        grid_names=("i",),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return kernel(x, w)


_skinny_kernel = lowered_once(_skinny_pallas, "block_n", "block_k", "splits", "stages")


def skinny_matmul(x, w, *, interpret: bool = False, **override):
    """x [G, M, K] @ w [G, K, N] -> [G, M, N] in w's dtype (fp32 accumulation), M <= 64."""
    g, m, k = x.shape
    n = w.shape[2]
    cfg = plan(g, k, n, num_sms=4 if interpret else NUM_SMS)
    cfg.update(override)
    mp = m if m <= 8 else round_up(m, 8)    # the tiled TMA layout: <= 8 rows or a multiple
    xx = x.astype(w.dtype)
    if mp != m:
        xx = jnp.pad(xx, ((0, 0), (0, mp - m), (0, 0)))
    parts = _skinny_kernel(xx, w, interpret=interpret, **cfg)
    y = parts.reshape(g, cfg["splits"], mp, n).sum(axis=1)
    return y[:, :m].astype(w.dtype)


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


linear_mgpu.available = grouped_linear_mgpu.available = on_hopper
linear_mgpu.prefers = linear_prefers
grouped_linear_mgpu.prefers = grouped_linear_prefers
