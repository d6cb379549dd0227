"""Flash-decode attention kernel for Hopper in Pallas Mosaic GPU, shared by the attention ops.

One softmax over a key list and a sink logit (spec §2.8), single KV head (K = V):

    o[t, h] = sum_j p[t, h, j] keys[g(t), j],
    p[t, h] = softmax([q[t, h] . keys[g(t)] / sqrt(d) + bias[t], sink[h]])

with the sink's probability dropped; token t reads key group g(t) = t // tokens_per_key
(`sparse_attention`: one gathered list a token; `attention`: one list per sequence, shared
by its T query tokens).

Kernel, grid (T, splits): a CTA streams its share of one token's keys through shared memory
(TMA, `stages` deep, one producer warpgroup) and two consumer warpgroups do, per block of
`block_k` keys, logits = q[H->64 rows, d] @ K^T (wgmma, each key loaded once for all H heads:
MQA), an online softmax in fp32 (exp2), and o += p @ K[:, half] (K = V; each warpgroup owns
d/2 output columns, so the fp32 accumulator is 64 x d/2 per warpgroup). It writes o / l and
the log2-sum-exp; XLA then merges the splits together with the sink logit:
out = sum_s w_s o_s / (sum_s w_s + 2^(sink2 - M)), w_s = 2^(lse_s - M).

Prefill tiles (`chunk_attention`, `tokens_per_cta` P > 1, one split): a CTA serves P
consecutive tokens of one key list, their P x H query rows in one 64-row wgmma tile (each
row takes its token's bias row), the softmax starts from the sink logit (no merge after
it), and with `skip_masked` the CTA visits only the key blocks where some of its tokens'
bias is finite (`live_blocks`: a count and the block indices, read by the producer).

Geometry (`supported_geometry`): bf16 / fp16 keys, d in {128, 256, 384, 512}, H a multiple
of 8 and <= 64. Keys [G, Lk, d] need Lk <= 8 or a multiple of 8 (the tiled TMA layout);
bias [T, L] with L a multiple of block_k * splits and L >= Lk: key rows past Lk are read as
zeros by the copy engine, so the bias must be -inf there.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from custom_calls._common import lowered_once, round_up

LOG2E = math.log2(math.e)
NUM_SMS = 132
MAX_HEADS = 64
_ROWS = 64  # wgmma M: heads padded to one warpgroup's 64 rows


def supported_geometry(heads: int, head_dim: int, dtype) -> bool:
    """Whether the kernel serves H heads of head_dim with keys of dtype."""
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and head_dim % 128 == 0 and head_dim <= 512 and heads % 8 == 0
            and heads <= MAX_HEADS)


def _kernel_call(q, keys, bias, sink_rows, *extra, tokens_per_key: int, splits: int,
                 block_k: int, stages: int, interpret: bool, qk_split: bool, fold_sink: bool,
                 skip: bool, scaled: bool, norm_eps: float | None = None, rope: int = 0):
    """q [C,R,d] (R = P x H rows: P tokens a CTA, heads fastest), keys [G,Lk,d], bias
    [C,P,L] fp32, sink_rows [64] fp32 (log2 units, row r's head's sink) -> o [C,splits,R,d]
    (keys' dtype) and lse2 [C,splits,64] fp32.

    extra: live (when skip), then row_scale [C,64] fp32 (when scaled): CTA c's row r logits
    are multiplied by row_scale[c, r] (a query scale folded into the logits), then (when
    rope) the rotation's lanes [C,2,P,rope] fp32 and the pair swap [rope,rope] (`rope_lanes`).

    A raw query (`prepare_query`): norm_eps (not None) multiplies row r's logits by its head
    RMS factor rsqrt(mean(q_r^2) + eps) (rounded to q's dtype, as `head_rms_factor` does),
    computed from the query tile in shared memory, each warpgroup summing its half of d;
    rope rotates the last `rope` channels of every row in shared memory before the first
    q @ K^T (warpgroup 1, which owns them): lane 2i: a cos - b sin, lane 2i+1: b cos + a sin,
    the pair-swapped tile (b, a) one wgmma with a permutation matrix.

    CTA c reads keys[c // (tokens_per_key / P)]; key rows past Lk read as zeros (TMA fills
    them). fold_sink: the softmax starts from the sink logit (max = sink, sum = 1), so o is
    final (one split only). live (optional, one split): [C, 1 + nblk] int32, CTA c's count n
    of key blocks to visit, then their indices: the other blocks (masked for all of its
    tokens) are neither loaded nor computed."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    t_count, h, d = q.shape
    per_cta, length = bias.shape[1:]
    heads = h // per_cta
    ctas_per_key = tokens_per_key // per_cta
    assert not fold_sink or splits == 1
    dtype = keys.dtype
    dh = d // 2
    nblk = length // block_k // splits
    assert nblk * block_k * splits == length
    stages = max(1, min(stages, nblk))
    scale2 = LOG2E / math.sqrt(d)

    prep = norm_eps is not None or rope > 0
    assert len(extra) == skip + scaled + 2 * (rope > 0)
    assert not skip or splits == 1
    assert not (scaled and norm_eps is not None)
    assert not prep or (qk_split and rope in (0, 64) and rope <= dh)

    def kernel(q_ref, k_ref, b_ref, s_ref, live_ref, r_ref, cs_ref, perm_ref, o_ref, lse_ref,
               scoped):
        (q_smem, k_smem, b_smem, lse_smem), (k_bar, b_bar, q_bar), consumed, done = scoped[:4]
        at = 4
        if qk_split:
            x_smem, x_bar = scoped[at:at + 2]
            at += 2
        if scaled:
            r_smem = scoped[at]
            at += 1
        if norm_eps is not None:
            ssq_smem, prep_bar = scoped[at:at + 2]
            at += 2
        if rope:
            cs_smem, perm_smem = scoped[at:at + 2]
        tok = lax.axis_index("t")
        split = lax.axis_index("split")
        wg = lax.axis_index("wg")
        base = split * (nblk * block_k)
        group = tok // ctas_per_key
        n_visit = jnp.maximum(live_ref[tok, 0], 1) if skip else nblk

        def head_rms_scale(wg):
            """[64] fp32 (WGMMA.reduce(1)): each row's head RMS factor from the raw query tile;
            warpgroup w sums the squares of its half of d, the halves meet in shared memory."""
            ssq = None
            for c in range(dh // 64):
                x = plgpu.load(q_smem.at[wg, :, pl.ds(c * 64, 64)],
                               layout=plgpu.Layout.WGMMA).astype(jnp.float32)
                part = (x * x).sum(axis=1)
                ssq = part if ssq is None else ssq + part
            ssq_smem.at[wg][...] = ssq
            plgpu.barrier_arrive(prep_bar.at[0])
            plgpu.barrier_wait(prep_bar.at[0])
            load = lambda w: plgpu.load(ssq_smem.at[w], layout=plgpu.Layout.WGMMA.reduce(1))
            total = load(0) + load(1)
            factor = lax.rsqrt(total * (1.0 / d) + norm_eps)
            return factor.astype(dtype).astype(jnp.float32)

        def rotate_tail():
            """The rope rotation of the last `rope` channels of q (warpgroup 1's half), in
            place; its ssq was read before (head_rms_scale)."""
            plgpu.barrier_wait(q_bar.at[4])
            plgpu.barrier_wait(q_bar.at[5])
            tail_ref = q_smem.at[1, :, pl.ds(dh - rope, rope)]
            tail = plgpu.load(tail_ref, layout=plgpu.Layout.WGMMA).astype(jnp.float32)

            def swap_scope(acc_ref):
                plgpu.wgmma(acc_ref, tail_ref, perm_smem)
                return acc_ref[...]
            swapped = pl.run_scoped(swap_scope, plgpu.ACC((_ROWS, rope), jnp.float32))
            cos = _row_lanes(cs_smem.at[0], swapped.shape)
            sin = _row_lanes(cs_smem.at[1], swapped.shape)
            tail_ref[...] = (tail * cos + swapped * sin).astype(dtype)
            plgpu.commit_smem()      # the rotated channels, visible to the wgmmas that read q

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            plgpu.barrier_wait(q_bar.at[0])
            plgpu.barrier_wait(q_bar.at[1])
            if fold_sink:     # the sink is key zero: its logit starts the max, its exp the sum
                plgpu.barrier_wait(q_bar.at[2])
                m_i = plgpu.load(lse_smem, layout=plgpu.Layout.WGMMA.reduce(1))
                l_i = plgpu.layout_cast(jnp.full((_ROWS,), 1.0, jnp.float32),
                                        plgpu.Layout.WGMMA.reduce(1))
            else:
                m_i = plgpu.layout_cast(jnp.full((_ROWS,), -1e30, jnp.float32),
                                        plgpu.Layout.WGMMA.reduce(1))
                l_i = plgpu.layout_cast(jnp.full((_ROWS,), 0.0, jnp.float32),
                                        plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.full((_ROWS, dh), 0.0, jnp.float32), plgpu.Layout.WGMMA)
            if scaled:
                plgpu.barrier_wait(q_bar.at[3])
                row_scale2 = plgpu.load(r_smem, layout=plgpu.Layout.WGMMA.reduce(1)) * scale2
            if norm_eps is not None:
                row_scale2 = head_rms_scale(wg) * scale2
            if rope:
                @pl.when(wg == 1)
                def _():
                    rotate_tail()

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
                if scaled or norm_eps is not None:
                    s = s * lax.broadcast_in_dim(row_scale2, s.shape, [0])
                else:
                    s = s * scale2
                s = s + _row_bias(b_smem.at[slot], s.shape)
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

            acc, m_i, l_i = lax.fori_loop(0, n_visit, step, (acc, m_i, l_i))
            # Both warpgroups are done reading q_smem (and lse_smem's sinks): reuse them.
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
            if fold_sink:
                plgpu.copy_gmem_to_smem(s_ref, lse_smem, q_bar.at[2])
            if scaled:
                plgpu.copy_gmem_to_smem(r_ref.at[tok], r_smem, q_bar.at[3])
            if rope:
                plgpu.copy_gmem_to_smem(cs_ref.at[tok], cs_smem, q_bar.at[4])
                plgpu.copy_gmem_to_smem(perm_ref, perm_smem, q_bar.at[5])

            def fetch(i, slot):
                start = base + (live_ref[tok, 1 + i] if skip else i) * block_k
                plgpu.copy_gmem_to_smem(k_ref.at[group, pl.ds(start, block_k)], k_smem.at[slot],
                                        k_bar.at[slot])
                plgpu.copy_gmem_to_smem(b_ref.at[tok, :, pl.ds(start, block_k)],
                                        b_smem.at[slot], b_bar.at[slot])

            def when_visited(i, fn):
                if skip:
                    pl.when(i < n_visit)(fn)
                else:
                    fn()

            for i in range(stages):
                when_visited(i, lambda i=i: fetch(i, i))

            @pl.loop(stages, n_visit)
            def _(i):
                slot = lax.rem(i, jnp.int32(stages))
                plgpu.barrier_wait(consumed.at[slot])
                fetch(i, slot)

            # Observe the last `stages` consumptions too (one a slot): every barrier phase
            # is then seen by each thread that waits on it, as the interpret mode checks.
            for slot in range(stages):
                when_visited(slot, lambda slot=slot: plgpu.barrier_wait(consumed.at[slot]))

    def _row_lanes(lanes, shape, scale: float = 1.0):
        """[P, n] per-token lanes (fp32 shared memory, each times `scale`) as a [64, n] tile:
        row r takes its token's (r // H) lanes."""
        def cols(j):
            v = plgpu.load(lanes.at[j], layout=plgpu.Layout.WGMMA.reduce(0))
            return lax.broadcast_in_dim(v * scale if scale != 1.0 else v, shape, [1])
        out = cols(0)
        if per_cta > 1:
            row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
            for j in range(1, per_cta):
                out = jnp.where(row >= j * heads, cols(j), out)
        return out

    def _row_bias(b_tile, shape):
        """The [P, block_k] bias tile as [64, block_k] log2-unit logits."""
        return _row_lanes(b_tile, shape, LOG2E)

    def flash_decode_split(q_ref, k_ref, b_ref, s_ref, *rest):
        live_ref = rest[0] if skip else None
        r_ref = rest[int(skip)] if scaled else None
        cs_ref, perm_ref = rest[skip + scaled:skip + scaled + 2] if rope else (None, None)
        o_ref, lse_ref = rest[-2:]
        tiling = plgpu.TilingTransform((8, 64))
        swizzle = plgpu.SwizzleTransform(128)
        smem = (
            plgpu.SMEM((2, _ROWS, dh), dtype, transforms=(tiling, swizzle)),  # q halves, then o
            plgpu.SMEM((stages, block_k, d), dtype, transforms=(tiling, swizzle)),
            plgpu.SMEM((stages, per_cta, block_k), jnp.float32),
            plgpu.SMEM((_ROWS,), jnp.float32),            # the sinks, then lse
        )
        bars = (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
                plgpu.Barrier(num_barriers=6 if rope else 4 if scaled else 3))
        extra = ()
        if qk_split:
            extra += (plgpu.SMEM((_ROWS, block_k), jnp.float32,
                                 transforms=(plgpu.TilingTransform((8, 32)), swizzle)),
                      plgpu.Barrier(num_arrivals=2, num_barriers=2))
        if scaled:
            extra += (plgpu.SMEM((_ROWS,), jnp.float32),)
        if norm_eps is not None:
            extra += (plgpu.SMEM((2, _ROWS), jnp.float32),                  # ssq halves
                      plgpu.Barrier(num_arrivals=2, num_barriers=1))
        if rope:
            extra += (plgpu.SMEM((2, per_cta, rope), jnp.float32),          # rope lanes
                      plgpu.SMEM((rope, rope), dtype, transforms=(tiling, swizzle)))  # swap
        if interpret:
            extra += (plgpu.SMEM((2, _ROWS, block_k), dtype, transforms=(tiling, swizzle)),)
        pl.run_scoped(
            lambda *scoped: kernel(q_ref, k_ref, b_ref, s_ref, live_ref, r_ref, cs_ref, perm_ref,
                                   o_ref, lse_ref, scoped),
            smem, bars,
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=1),
            *extra,
            collective_axes="wg",
        )

    return plgpu.kernel(
        flash_decode_split,
        out_type=(jax.ShapeDtypeStruct((t_count, splits, h, d), dtype),
                  jax.ShapeDtypeStruct((t_count, splits, _ROWS), jnp.float32)),
        grid=(t_count, splits),
        grid_names=("t", "split"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(q, keys, bias, sink_rows, *extra)


_kernel = lowered_once(_kernel_call, "tokens_per_key", "splits", "block_k", "stages", "qk_split",
                       "fold_sink", "skip", "scaled", "norm_eps", "rope")


def choose_splits(tokens: int, nblk: int, num_sms: int = NUM_SMS) -> int:
    """Split each token's keys over CTAs until about half the SMs are busy: the smallest
    divisor of the block count with tokens * splits >= SMs / 2 (else all blocks). More
    splits add partial outputs (H x d a split) to write and merge."""
    for sp in range(1, nblk + 1):
        if nblk % sp == 0 and tokens * sp >= num_sms // 2:
            return sp
    return nblk


def plan(tokens: int, n_keys: int, block_k: int, splits: int | None, interpret: bool):
    """(splits, L): the key splits a token and the padded key length L (bias columns).
    L covers n_keys in whole blocks and is a multiple of block_k * splits."""
    nblk = -(-n_keys // block_k)
    if splits is None:
        splits = choose_splits(tokens, nblk, 4 if interpret else NUM_SMS)
    multiple = splits if nblk % splits else 1
    return splits, round_up(nblk * block_k, block_k * multiple)


def live_blocks(bias, block_k: int):
    """bias [C, P, L] fp32 -> [C, 1 + L / block_k] int32: a CTA's count of key blocks with
    some finite bias, then those blocks' indices in order (the rest: unused)."""
    c, p, length = bias.shape
    live = jnp.isfinite(bias.reshape(c, p, length // block_k, block_k)).any(axis=(1, 3))
    order = jnp.argsort(~live, axis=1, stable=True).astype(jnp.int32)
    return jnp.concatenate([live.sum(axis=1, dtype=jnp.int32)[:, None], order], axis=1)


def rope_lanes(cos, sin):
    """cos, sin [T, r/2] -> [T, 2, r] fp32: per lane, the factor of the lane itself (cos) and
    of its pair-swapped partner (lane 2i: -sin, lane 2i+1: +sin), as `apply_rope` rotates."""
    c = jnp.repeat(cos.astype(jnp.float32), 2, axis=-1)
    s = jnp.repeat(sin.astype(jnp.float32), 2, axis=-1)
    sign = jnp.where(jnp.arange(c.shape[-1]) % 2 == 0, -1.0, 1.0)
    return jnp.stack([c, s * sign], axis=1)


def pair_swap(r: int, dtype) -> jax.Array:
    """[r, r] permutation: x @ P swaps the lanes of every pair (2i, 2i+1)."""
    i = jnp.arange(r)
    return (i[:, None] == (i[None, :] ^ 1)).astype(dtype)


def prepares_query(head_dim: int, rope: int) -> bool:
    """Whether the kernel prepares a raw query itself (head RMS, rotation of the last `rope`
    channels): rope is 0 or one 64-lane tile inside the second half of d."""
    return rope in (0, 64) and rope <= head_dim // 2


def flash_decode(q, keys, bias, sinks, *, tokens_per_key: int = 1, splits: int, block_k: int = 64,
                 stages: int = 2, qk_split: bool = True, tokens_per_cta: int = 1,
                 skip_masked: bool = False, q_scale=None, q_norm_eps: float | None = None,
                 q_rope=None, interpret: bool = False):
    """q [T,H,d]; keys [G,Lk,d] (K = V, G = T / tokens_per_key); bias [T,L] fp32 additive
    (L a multiple of block_k * splits, -inf past Lk); sinks [H] fp32 -> o [T,H,d] in keys' dtype.

    q_scale [T,H] (optional): each query row's scale, applied to its logits (q scaled by it).

    tokens_per_cta P > 1 (P x H <= 64 rows, P dividing T and tokens_per_key; one split): a
    CTA serves P consecutive tokens of one key list, each key block loaded once for all of
    them, and the sink enters the softmax in the kernel (no merge after it): prefill tiles.
    skip_masked (one split): a CTA visits only the key blocks where some bias of its tokens
    is finite (`live_blocks`).
    q_norm_eps, q_rope = (cos, sin) [T, r/2] (optional, `prepares_query`): q is raw; the
    kernel applies the head RMS factor to each row's logits and rotates the last r channels
    (`kernels_xla.prepared_query`'s query, up to rounding)."""
    t_count, h, d = q.shape
    g, lk, d2 = keys.shape
    p = tokens_per_cta
    if not supported_geometry(h, d, keys.dtype) or d2 != d:
        raise ValueError(f"flash_decode: unsupported geometry q{q.shape} keys{keys.shape} "
                         f"{keys.dtype}")
    if g * tokens_per_key != t_count or bias.shape[0] != t_count:
        raise ValueError(f"flash_decode: q{q.shape} bias{bias.shape} keys{keys.shape} "
                         f"tokens_per_key={tokens_per_key} disagree")
    if bias.shape[1] % (block_k * splits) or bias.shape[1] < lk or (lk > 8 and lk % 8):
        raise ValueError(f"flash_decode: bias length {bias.shape[1]} / key length {lk} do not fit "
                         f"block_k={block_k} x splits={splits}")
    if p < 1 or p * h > _ROWS or tokens_per_key % p or (p > 1 and splits != 1):
        raise ValueError(f"flash_decode: tokens_per_cta={p} needs P x H <= {_ROWS}, P dividing "
                         f"tokens_per_key={tokens_per_key} and one split (got {splits})")
    rope = 0 if q_rope is None else 2 * q_rope[0].shape[-1]
    if (q_norm_eps is not None or rope) and (not qk_split or not prepares_query(d, rope)):
        raise ValueError(f"flash_decode: the kernel prepares a query of d={d} with a rotation of "
                         f"64 lanes (got {rope}) only, with qk_split")
    if q_norm_eps is not None and q_scale is not None:
        raise ValueError("flash_decode: q_scale and q_norm_eps exclude each other")
    dtype = keys.dtype
    sink2 = sinks.astype(jnp.float32) * LOG2E                # [H]
    fold = p > 1
    sink_rows = jnp.pad(jnp.tile(sink2, p), (0, _ROWS - p * h))
    if skip_masked and splits != 1:
        raise ValueError(f"flash_decode: skip_masked needs one split (got {splits})")
    bias = bias.astype(jnp.float32).reshape(t_count // p, p, -1)
    extra = (live_blocks(bias, block_k),) if skip_masked else ()
    if q_scale is not None:
        if q_scale.shape != (t_count, h):
            raise ValueError(f"flash_decode: q_scale{q_scale.shape} must be {(t_count, h)}")
        rows = q_scale.astype(jnp.float32).reshape(t_count // p, p * h)
        extra += (jnp.pad(rows, ((0, 0), (0, _ROWS - p * h)), constant_values=1.0),)
    if rope:
        cos, sin = q_rope
        if cos.shape != (t_count, rope // 2) or sin.shape != cos.shape:
            raise ValueError(f"flash_decode: q_rope cos{cos.shape} sin{sin.shape} must be "
                             f"{(t_count, rope // 2)}")
        lanes = rope_lanes(cos, sin).reshape(t_count // p, p, 2, rope).transpose(0, 2, 1, 3)
        extra += (lanes, pair_swap(rope, dtype))
    o, lse2 = _kernel(q.astype(dtype).reshape(t_count // p, p * h, d), keys, bias, sink_rows,
                      *extra,
                      tokens_per_key=tokens_per_key, splits=splits, block_k=block_k,
                      stages=stages, interpret=interpret, qk_split=qk_split, fold_sink=fold,
                      skip=skip_masked, scaled=q_scale is not None,
                      norm_eps=None if q_norm_eps is None else float(q_norm_eps), rope=rope)
    if fold:
        return o.reshape(t_count, h, d)
    lse2 = lse2[..., :h]                                     # [T, splits, H]
    mx = jnp.maximum(lse2.max(axis=1), sink2[None])          # [T, H]
    wts = jnp.exp2(lse2 - mx[:, None])                       # [T, splits, H]
    den = wts.sum(axis=1) + jnp.exp2(sink2[None] - mx)       # [T, H]
    # A broadcast-multiply-reduce (one fusion), not a dot: cuBLAS would add launches.
    out = (wts[..., None] * o.astype(jnp.float32)).sum(axis=1) / den[..., None]
    return out.astype(dtype)
