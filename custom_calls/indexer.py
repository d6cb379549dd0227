"""Lightning-indexer scores of a prefill chunk for Hopper in Pallas Mosaic GPU
(`index_scores`/`mosaic_gpu`).

Contract (deepinfer_fn.kernels.index_scores, spec §2.7): I(t, w) = sum_h omega[t, h]
relu(q[t, h] . K[w]) / sqrt(d_I), fp32, for q [B,T,H,d_I], omega [B,T,H] fp32, K [B,N,d_I].

XLA materialises the [B, T, N, H] fp32 dots (at `mini`'s 1 x 4096 prefill: 537 MB a CSA
layer) and reads them back for the head sum. The kernel keeps them in registers: a CTA
takes P = 256 / H tokens (their P x H query rows, heads fastest), streams the keys in
blocks of 64 rows (TMA pipeline), computes dots^T [64 keys, P x H] = K_blk q^T (wgmma, fp32
accumulation of bf16 products, as XLA's dot), applies relu and the head weights, and sums
each token's H columns: only the [P, 64] scores leave the SM.

Supported (`supported`): bf16 / fp16 operands, d_I a multiple of 64 and <= 256, H dividing
256 with H >= 8, at least MIN_TOKENS tokens a row (prefill); everything else is the XLA
reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from custom_calls._common import lowered_once, on_hopper, round_up
from deepinfer_fn import kernels_xla

MIN_TOKENS = 64        # decode and verify chunks: XLA (its dots are small there)
_COLS = 256            # query rows (tokens x heads) a CTA: one wgmma's N
_BLOCK_N = 64          # keys a pipeline step (wgmma M)


def supported(q_index, head_weights, index_rows) -> bool:
    b, t, h, d = q_index.shape
    return (jnp.dtype(index_rows.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and d % 64 == 0 and d <= 256 and 8 <= h <= _COLS and _COLS % h == 0
            and t >= MIN_TOKENS and index_rows.shape[0] == b and index_rows.shape[2] == d
            and head_weights.shape == (b, t, h))


def _scores_call(q2, w2, keys, *, heads: int, stages: int):
    """q2 [B, C*256, d], w2 [B, C*256] fp32, keys [B, Np, d] -> scores [B, C*P, Np] fp32."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    b, rows, d = q2.shape
    n_keys = keys.shape[1]
    per_cta = _COLS // heads
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def index_scores(q_ref, w_ref, k_ref, o_ref):
        bi = lax.axis_index("b")
        ci = lax.axis_index("c")

        def body(q_smem, w_smem, o_smem, bars):
            plgpu.copy_gmem_to_smem(q_ref.at[bi, pl.ds(ci * _COLS, _COLS)], q_smem, bars.at[0])
            plgpu.copy_gmem_to_smem(w_ref.at[bi, pl.ds(ci * _COLS, _COLS)], w_smem, bars.at[1])
            plgpu.barrier_wait(bars.at[0])
            plgpu.barrier_wait(bars.at[1])
            shape = (_BLOCK_N, _COLS)
            weight = lax.broadcast_in_dim(
                plgpu.load(w_smem, layout=plgpu.Layout.WGMMA.reduce(0)), shape, [1])
            col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)

            def step(idx, k_smem):
                def dots(acc_ref):
                    plgpu.wgmma(acc_ref, k_smem, q_smem.transpose((1, 0)))
                    return acc_ref[...]
                val = jnp.maximum(pl.run_scoped(dots, plgpu.ACC(shape, jnp.float32)), 0.0) * weight
                out = o_smem.at[lax.rem(idx[0], 2)]       # double-buffered scores [P, 64]
                for j in range(per_cta):
                    mine = (col >= j * heads) & (col < (j + 1) * heads)
                    out[j] = jnp.where(mine, val, 0.0).sum(axis=1)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    out, o_ref.at[bi, pl.ds(ci * per_cta, per_cta), pl.ds(idx[0] * _BLOCK_N,
                                                                          _BLOCK_N)])
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)   # the other buffer is free

            plgpu.emit_pipeline(
                step, grid=(n_keys // _BLOCK_N,),
                in_specs=[plgpu.BlockSpec((_BLOCK_N, d), lambda n: (n, 0),
                                          transforms=transforms)],
                max_concurrent_steps=stages,
            )(k_ref.at[bi])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(body, plgpu.SMEM((_COLS, d), q2.dtype, transforms=transforms),
                      plgpu.SMEM((_COLS,), jnp.float32),
                      plgpu.SMEM((2, per_cta, _BLOCK_N), jnp.float32),
                      plgpu.Barrier(num_barriers=2))

    return plgpu.kernel(
        index_scores,
        out_type=jax.ShapeDtypeStruct((b, rows // heads, n_keys), jnp.float32),
        grid=(b, rows // _COLS),
        grid_names=("b", "c"),
    )(q2, w2, keys)


_kernel = lowered_once(_scores_call, "heads", "stages")


def index_scores_mgpu(q_index, head_weights, index_rows, *, interpret: bool = False,
                      stages: int = 2):
    """Registry signature (deepinfer_fn.kernels.index_scores); unsupported inputs (see
    `supported`) are served by the XLA reference."""
    if not supported(q_index, head_weights, index_rows):
        return kernels_xla.index_scores(q_index, head_weights, index_rows)
    b, t, h, d = q_index.shape
    n = index_rows.shape[1]
    per_cta = _COLS // h
    tp, n_pad = round_up(t, per_cta), round_up(n, _BLOCK_N)
    dtype = index_rows.dtype
    q2 = jnp.pad(q_index.astype(dtype), ((0, 0), (0, tp - t), (0, 0), (0, 0)))
    w2 = jnp.pad(head_weights.astype(jnp.float32) * d ** -0.5, ((0, 0), (0, tp - t), (0, 0)))
    keys = jnp.pad(index_rows, ((0, 0), (0, n_pad - n), (0, 0)))
    out = _kernel(q2.reshape(b, tp * h, d), w2.reshape(b, tp * h), keys, heads=h,
                  stages=stages, interpret=interpret)
    return out[:, :t, :n]


index_scores_mgpu.available = on_hopper
index_scores_mgpu.prefers = supported
