"""Decode sparse attention for Hopper in Pallas Mosaic GPU (`sparse_attention`/`mosaic_gpu`).

Contract (deepinfer_fn.kernels.sparse_attention): q [B,S,H,d]; window_kv [B,Wk,d] (K = V);
window_bias [B,S,Wk] fp32 (0 / -inf); rows [B,N,d]; row_idx [B,S,K] int32 (-1 = masked);
sinks [H] fp32. One softmax over [window logits, row logits, sink], the sink's value zero.

Structure:
1. XLA (one fusion): for each query token t = (b, s) the key list
   keys[t] = [window_kv[b], rows[b, row_idx[b, s]], zero padding] ([T, L, d]) and its additive
   bias ([T, L] fp32: window_bias, 0 / -inf for the rows, -inf for the padding).
   The gather stays in XLA: Hopper's TMA cannot gather rows (that is Blackwell's
   `gather4`), and a wgmma operand in shared memory must sit in 8-row swizzled atoms, so
   a row-by-row gather would take 8 TMA copies a row; Pallas Mosaic GPU exposes no
   `cp.async` path on sm_90 either.
2. Pallas kernel, grid (T, splits): a CTA streams its share of one token's keys through
   shared memory (TMA, `stages` deep, one producer warpgroup) and two consumer
   warpgroups do, per block of `block_k` keys, logits = q[H->64 rows, d] @ K^T (wgmma,
   each key loaded once for all H heads: MQA), an online softmax in fp32 (exp2), and
   o += p @ K[:, half] (K = V; each warpgroup owns d/2 output columns, so the fp32
   accumulator is 64 x d/2 per warpgroup). It writes o / l (bf16) and the log2-sum-exp.
3. XLA: the splits are merged together with the sink logit: out = sum_s w_s o_s /
   (sum_s w_s + 2^(sink2 - M)), w_s = 2^(lse_s - M).

Supported: bf16 / fp16 keys, d in {128, 256, 384, 512}, H a multiple of 8 and <= 64,
S <= 16 query tokens a sequence. Anything else falls back to the XLA reference.

Measured on an H200 (benchmarks/results/kernels_h200.json; H=32, d=512, Wk=128, K=512):
B=1 / 16 / 64: 12.3 / 20.5 / 49.2 us against XLA's 17.6 / 43.2 / 94.4 us. At B=64 the XLA
gather is 25 us of the 49 (it writes every selected row once more and the kernel reads it
back), the kernel 18 us (2.4 TB/s on the keys it streams): an in-kernel gather is the next
step, and on Hopper it needs per-thread `cp.async` / `ld.global` row copies, which this
Pallas version does not expose for sm_90.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from custom_calls._common import maybe_interpret, on_hopper, round_up

LOG2E = math.log2(math.e)
NUM_SMS = 132
_ROWS = 64  # wgmma M: heads padded to one warpgroup's 64 rows


def _kernel_call(q, keys, bias, *, splits: int, block_k: int, stages: int, interpret: bool,
                 qk_split: bool):
    """q [T,H,d], keys [T,L,d], bias [T,L] fp32 -> o [T,splits,H,d] (keys' dtype), lse2 [T,splits,64]."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    t_count, h, d = q.shape
    _, length, _ = keys.shape
    dtype = keys.dtype
    dh = d // 2
    nblk = length // block_k // splits
    assert nblk * block_k * splits == length
    stages = max(1, min(stages, nblk))
    scale2 = LOG2E / math.sqrt(d)

    def kernel(q_ref, k_ref, b_ref, o_ref, lse_ref, scoped):
        (q_smem, k_smem, b_smem, lse_smem), (k_bar, b_bar, q_bar), consumed, done = scoped[:4]
        if qk_split:
            x_smem, x_bar = scoped[4:6]
        tok = lax.axis_index("t")
        split = lax.axis_index("split")
        wg = lax.axis_index("wg")
        base = split * (nblk * block_k)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            plgpu.barrier_wait(q_bar.at[0])
            plgpu.barrier_wait(q_bar.at[1])
            m_i = plgpu.layout_cast(jnp.full((_ROWS,), -1e30, jnp.float32),
                                    plgpu.Layout.WGMMA.reduce(1))
            l_i = plgpu.layout_cast(jnp.full((_ROWS,), 0.0, jnp.float32),
                                    plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.full((_ROWS, dh), 0.0, jnp.float32), plgpu.Layout.WGMMA)

            def step(i, carry):
                acc, m_i, l_i = carry
                slot = lax.rem(i, jnp.int32(stages))
                plgpu.barrier_wait(k_bar.at[slot])
                plgpu.barrier_wait(b_bar.at[slot])

                if qk_split:
                    # Each warpgroup contracts its own half of d; the two partial logit
                    # tiles are summed through shared memory (no duplicated q @ K^T).
                    def qk_half_scope(acc_ref):
                        k_half = k_smem.at[slot, :, pl.ds(wg * dh, dh)]
                        plgpu.wgmma(acc_ref, q_smem.at[wg], k_half.transpose((1, 0)))
                        return acc_ref[...]
                    part = pl.run_scoped(qk_half_scope, plgpu.ACC((_ROWS, block_k), jnp.float32))
                    # One fp32 tile of shared memory (the budget is full): warpgroup 1 puts
                    # its partial there, warpgroup 0 adds it and puts the sum back.
                    load_x = lambda: plgpu.load(x_smem, layout=plgpu.Layout.WGMMA)

                    @pl.when(wg == 1)
                    def _():
                        x_smem[...] = part
                    plgpu.barrier_arrive(x_bar.at[0])
                    plgpu.barrier_wait(x_bar.at[0])
                    s = lax.cond(wg == 0, lambda: part + load_x(), lambda: part)

                    @pl.when(wg == 0)
                    def _():
                        x_smem[...] = s
                    plgpu.barrier_arrive(x_bar.at[1])
                    plgpu.barrier_wait(x_bar.at[1])
                    s = lax.cond(wg == 0, lambda: s, load_x)
                else:
                    def qk_scope(acc_ref):
                        for half in range(2):
                            k_half = k_smem.at[slot, :, pl.ds(half * dh, dh)]
                            plgpu.wgmma(acc_ref, q_smem.at[half], k_half.transpose((1, 0)))
                        return acc_ref[...]
                    s = pl.run_scoped(qk_scope, plgpu.ACC((_ROWS, block_k), jnp.float32))
                bias2 = plgpu.load(b_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
                s = s * scale2 + lax.broadcast_in_dim(bias2 * LOG2E, s.shape, [1])
                m_new = jnp.maximum(m_i, s.max(axis=1))
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                l_i = l_i * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                p16 = p.astype(dtype)

                v_half = k_smem.at[slot, :, pl.ds(wg * dh, dh)]
                if interpret:
                    # GPU interpret mode has no rule for run_state over an accumulator:
                    # same arithmetic through a fresh accumulator (registers are free there).
                    # Its wgmma also wants A in shared memory, not registers.
                    p_smem = scoped[-1].at[wg]
                    p_smem[...] = p16
                    plgpu.commit_smem()

                    def pv_fresh(acc_ref):
                        plgpu.wgmma(acc_ref, p_smem, v_half)
                        return acc_ref[...]
                    acc = acc + pl.run_scoped(pv_fresh, plgpu.ACC((_ROWS, dh), jnp.float32))
                else:
                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, p16, v_half)
                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(consumed.at[slot])
                return acc, m_new, l_i

            acc, m_i, l_i = lax.fori_loop(0, nblk, step, (acc, m_i, l_i))
            # Both warpgroups are done reading q_smem: reuse it for the output.
            plgpu.barrier_arrive(done.at[0])
            plgpu.barrier_wait(done.at[0])
            l_safe = jnp.maximum(l_i, 1e-30)
            out = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
            o_smem = q_smem.at[wg]
            o_smem[...] = out.astype(dtype)

            @pl.when(wg == 0)
            def _():
                lse_smem[...] = m_i + jnp.log2(l_i)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, h)],
                                    o_ref.at[tok, split, :, pl.ds(wg * dh, dh)])

            @pl.when(wg == 0)
            def _():
                plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[tok, split])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")
            for half in range(2):
                plgpu.copy_gmem_to_smem(q_ref.at[tok, :, pl.ds(half * dh, dh)],
                                        q_smem.at[half, pl.ds(0, h)], q_bar.at[half])

            def fetch(i, slot):
                start = base + i * block_k
                plgpu.copy_gmem_to_smem(k_ref.at[tok, pl.ds(start, block_k)], k_smem.at[slot],
                                        k_bar.at[slot])
                plgpu.copy_gmem_to_smem(b_ref.at[tok, pl.ds(start, block_k)], b_smem.at[slot],
                                        b_bar.at[slot])

            for i in range(stages):
                fetch(i, i)

            @pl.loop(stages, nblk)
            def _(i):
                slot = lax.rem(i, jnp.int32(stages))
                plgpu.barrier_wait(consumed.at[slot])
                fetch(i, slot)

    def entry(q_ref, k_ref, b_ref, o_ref, lse_ref):
        tiling = plgpu.TilingTransform((8, 64))
        swizzle = plgpu.SwizzleTransform(128)
        smem = (
            plgpu.SMEM((2, _ROWS, dh), dtype, transforms=(tiling, swizzle)),  # q halves, then o
            plgpu.SMEM((stages, block_k, d), dtype, transforms=(tiling, swizzle)),
            plgpu.SMEM((stages, block_k), jnp.float32),
            plgpu.SMEM((_ROWS,), jnp.float32),
        )
        bars = (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
                plgpu.Barrier(num_barriers=2))
        extra = ()
        if qk_split:
            extra += (plgpu.SMEM((_ROWS, block_k), jnp.float32,
                                 transforms=(plgpu.TilingTransform((8, 32)), swizzle)),
                      plgpu.Barrier(num_arrivals=2, num_barriers=2))
        if interpret:
            extra += (plgpu.SMEM((2, _ROWS, block_k), dtype, transforms=(tiling, swizzle)),)
        pl.run_scoped(
            lambda *scoped: kernel(q_ref, k_ref, b_ref, o_ref, lse_ref, scoped),
            smem, bars,
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=1),
            *extra,
            collective_axes="wg",
        )

    return plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct((t_count, splits, h, d), dtype),
                  jax.ShapeDtypeStruct((t_count, splits, _ROWS), jnp.float32)),
        grid=(t_count, splits),
        grid_names=("t", "split"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(q, keys, bias)


def choose_splits(tokens: int, nblk: int, num_sms: int = NUM_SMS) -> int:
    """Split each token's keys over CTAs until about half the SMs are busy: the smallest
    divisor of the block count with tokens * splits >= SMs / 2 (else all blocks). More
    splits add partial outputs (H x d a split) to write and merge."""
    for sp in range(1, nblk + 1):
        if nblk % sp == 0 and tokens * sp >= num_sms // 2:
            return sp
    return nblk


MAX_TOKENS = 16  # S a sequence: decode and speculative verify. Larger S (prefill) would
# materialise the window once a token ([B*S, Wk + K, d]); the XLA reference serves it.


def supported(q, window_kv) -> bool:
    s, h, d = q.shape[-3:]
    return (window_kv.dtype in (jnp.bfloat16, jnp.float16) and d % 128 == 0 and d <= 512
            and h % 8 == 0 and h <= _ROWS and s <= MAX_TOKENS)


def gather_keys(window_kv, window_bias, rows, row_idx, block_k: int, multiple: int = 1):
    """keys [B*S, L, d] and bias [B*S, L] fp32, L = Wk + K rounded up to block_k * multiple."""
    b, s, k = row_idx.shape
    wk, d = window_kv.shape[1:]
    dtype = window_kv.dtype
    length = round_up(wk + k, block_k * multiple)
    gathered = jnp.take_along_axis(rows.astype(dtype)[:, None], jnp.maximum(row_idx, 0)[..., None],
                                   axis=2)
    keys = jnp.concatenate(
        [jnp.broadcast_to(window_kv[:, None], (b, s, wk, d)), gathered,
         jnp.zeros((b, s, length - wk - k, d), dtype)], axis=2)
    bias = jnp.concatenate(
        [window_bias.astype(jnp.float32), jnp.where(row_idx >= 0, 0.0, -jnp.inf),
         jnp.full((b, s, length - wk - k), -jnp.inf)], axis=2).astype(jnp.float32)
    return keys.reshape(b * s, length, d), bias.reshape(b * s, length)


def sparse_attention_mgpu(q, window_kv, window_bias, rows, row_idx, sinks, *,
                          interpret: bool = False, block_k: int = 64, stages: int = 2,
                          splits: int | None = None, qk_split: bool = True):
    if not supported(q, window_kv):
        from deepinfer_fn.kernels import _sparse_attention_xla
        return _sparse_attention_xla(q, window_kv, window_bias, rows, row_idx, sinks)
    b, s, h, d = q.shape
    dtype = window_kv.dtype
    t_count = b * s
    nblk_total = -(-(window_kv.shape[1] + row_idx.shape[-1]) // block_k)
    if splits is None:
        splits = choose_splits(t_count, nblk_total, 4 if interpret else NUM_SMS)
    multiple = splits if nblk_total % splits else 1
    keys, bias = gather_keys(window_kv, window_bias, rows, row_idx, block_k, multiple)
    with maybe_interpret(interpret):
        o, lse2 = _kernel_call(q.astype(dtype).reshape(t_count, h, d), keys, bias,
                               splits=splits, block_k=block_k, stages=stages,
                               interpret=interpret, qk_split=qk_split)
    lse2 = lse2[..., :h]                                     # [T, splits, H]
    sink2 = sinks.astype(jnp.float32) * LOG2E                # [H]
    mx = jnp.maximum(lse2.max(axis=1), sink2[None])          # [T, H]
    wts = jnp.exp2(lse2 - mx[:, None])                       # [T, splits, H]
    den = wts.sum(axis=1) + jnp.exp2(sink2[None] - mx)       # [T, H]
    # A broadcast-multiply-reduce (one fusion), not a dot: cuBLAS would add launches.
    out = (wts[..., None] * o.astype(jnp.float32)).sum(axis=1) / den[..., None]
    return out.reshape(b, s, h, d).astype(dtype)


sparse_attention_mgpu.available = on_hopper
