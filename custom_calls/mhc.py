"""mHC sides of a sub-block for Hopper in Pallas Mosaic GPU (`mhc_pre` / `mhc_post`, mosaic_gpu).

Contracts: deepinfer_fn.kernels.mhc_pre / mhc_post (spec §2.3, §2.2). One kernel a side.

Pre side, one CTA (one warpgroup) per block of 64 tokens, two pipelined passes over D:
1. per 64-column step and stream j: u^T += F_j^T X_j^T on the tensor cores (wgmma, fp32
   accumulation; gate columns as M, tokens as N), and the token's Gram matrix
   G[j,k] = <X_j, X_k> in registers. The fp32 mixing weights enter as two bf16 halves,
   F = [hi | lo] (hi = fn's top 16 bits, lo = bf16(fn - hi), 24 columns each padded to 32,
   built by `prepare_fn` in XLA): X is bf16, so X @ hi + X @ lo carries fn to 16 mantissa
   bits (relative error ~1e-5 against HIGHEST's fp32).
   u^T goes through shared memory, so that each gate column comes back as a 64-token vector
   in the row layout of the stream tiles. Then, per token, elementwise on those vectors:
   rms(flatten(X)) from trace(G), the gates, the Sinkhorn iterations (a loop inside the
   kernel), and the collapsed stream's RMS from the Gram matrix, sum_jk pre_j pre_k G[j,k]
   (the reference takes it after rounding h to bf16: the two differ by ~1e-5 relative).
2. h = sum_j pre_j X_j, rounded to bf16, times the RMS and the norm weight: written out.
   The gates go out transposed, gates^T [n_out, blocks * 64] fp32 (pre 0:n, post n:2n,
   comb 2n:); the wrapper transposes post and comb back and mhc_post_mgpu transposes them
   again, a pair XLA cancels.
Post side, grid (token blocks, column splits), a pipelined pass over its columns:
X'_k = post_k y + sum_j comb[j,k] X_j with the reference's bf16 roundings (comb and post
rounded to bf16, the product and the mix each rounded, then their sum).
Hybrid pre side (decode steps, short prompts): XLA projects the streams and writes the
affine-mapped gate logits in a token-minor layout; one small kernel (`mhc_gates`, the Sinkhorn
kernel with the sigmoids) turns them into the gates^T of the other paths; XLA collapses and
normalises. XLA's post side reads the gates as per-token slices of that layout, so neither
side transposes them in a kernel of its own.

Supported: bf16 streams, n * (n + 2) <= 32 (n = 4: 24), D a multiple of 64. Anything else
falls back to the XLA reference. Tokens need not fill the last block: loads past N read
zeros and stores past N are dropped by the copy engine; only a token count above 8 that
is not a multiple of 8 is padded (TMA on the tiled layout wants <= 8 or a multiple of 8 rows:
a copy of the streams, so keep N a multiple of 8 in prefill).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from custom_calls._common import lowered_once, on_hopper, round_up
from deepinfer_fn.model.common import rms_norm
from deepinfer_fn.model.mhc_math import collapse, expand, mhc_weights, sinkhorn

TOK = 64        # tokens a CTA: the wgmma M
COLS = 64       # stream columns a pipeline step (128 bytes of bf16: one swizzle atom)
GATES = 32      # gate columns, padded: pre, post, comb, zeros
NUM_SMS = 132


def supported(streams) -> bool:
    n, d = streams.shape[-2:]
    return streams.dtype == jnp.bfloat16 and d % COLS == 0 and (2 + n) * n <= GATES


# Widest streams (n * D) the platform preference sends to these kernels. One CTA walks a token
# block's n * D columns in 64-column steps, so the pre side's latency grows with D. On the H200
# (benchmarks/results/compile_stages_h200.json, "mhc_mosaic_probe"), decode at batch 16: the
# default model (4 x 256) stepped in 0.52 ms instead of 0.65 ms, `mini` (4 x 2048) in 3.08 ms
# instead of 2.13 ms; both compiled in under half the time (the Sinkhorn leaves XLA's fusion).
PREFER_MAX_STREAM_WIDTH = 1024

# Fewest tokens for which narrow streams take the one-kernel pre side and the post kernel.
# Below it (decode steps, short prompts) the pre side is the hybrid path and the post side
# XLA's: on an H100 host the one kernel took 6.3 s of Mosaic GPU lowering (layout inference)
# and the post kernel 1.5 s, 7.7 s of the default model's 11.5 s decode-step lowering. The
# hybrid side launches more kernels (15 more in that step) yet steps faster: on an H100 the
# default model's decode loop took 0.52 ms instead of 0.58 ms a step at batch 1, and lowered in
# 3.2 s instead of 7.7 s (benchmarks/results/mhc_threshold_h100.json).
ONE_KERNEL_MIN_TOKENS = 128


def mhc_pre_prefers(streams, *args, **kwargs) -> bool:
    """The pre side's kernels are chosen at every supported width (`choose_pre_path`)."""
    return supported(streams)


def mhc_prefers(streams, *args, **kwargs) -> bool:
    """Whether the platform preference takes the Mosaic mHC post kernel for `streams`
    [N, n, D]: narrow streams, at least ONE_KERNEL_MIN_TOKENS tokens."""
    n, d = streams.shape[-2:]
    ntok = math.prod(streams.shape[:-2])
    return (supported(streams) and n * d <= PREFER_MAX_STREAM_WIDTH
            and ntok >= ONE_KERNEL_MIN_TOKENS)


def _pad_tokens(x: jax.Array) -> jax.Array:
    """TMA on the tiled layout wants a token count <= 8 or a multiple of 8: pad rows then."""
    ntok = x.shape[0]
    padded = ntok if ntok <= 8 else round_up(ntok, 8)
    if padded == ntok:
        return x
    return jnp.pad(x, ((0, padded - ntok),) + ((0, 0),) * (x.ndim - 1))


def prepare_fn(fn: jax.Array) -> jax.Array:
    """fn [n*D, n_out] fp32 -> [n*D, 2 * GATES] bf16 = [hi, 0 | lo, 0] with hi + lo ~ fn.

    hi keeps fn's top 16 bits (a bf16 value, by masking: XLA on GPU may drop an
    f32 -> bf16 -> f32 round trip under its default excess-precision rule, which would make
    lo zero), lo = bf16(fn - hi): |hi + lo - fn| <= 2^-16 |fn|.
    """
    f = fn.astype(jnp.float32)
    bits = lax.bitcast_convert_type(f, jnp.uint32) & jnp.uint32(0xFFFF0000)
    hi = lax.bitcast_convert_type(bits, jnp.float32)
    lo = (f - hi).astype(jnp.bfloat16)
    pad = ((0, 0), (0, GATES - f.shape[1]))
    return jnp.concatenate([jnp.pad(hi.astype(jnp.bfloat16), pad), jnp.pad(lo, pad)], axis=1)


def _bf16_transforms():
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def _f32_transforms():
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))


def _round(x, dtype):
    return x.astype(dtype).astype(jnp.float32)


def _sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def _gates(u, scale, base, n: int, iters: int, hc_eps: float):
    """Per-token gates from the logits u (list of n_out token vectors): pre, post, comb[j][k]."""
    pre = [_sigmoid(scale[0] * u[j] + base[j]) + hc_eps for j in range(n)]
    post = [2.0 * _sigmoid(scale[1] * u[n + j] + base[n + j]) for j in range(n)]
    m = [[scale[2] * u[2 * n + n * j + k] + base[2 * n + n * j + k] for k in range(n)]
         for j in range(n)]
    return pre, post, _sinkhorn_vectors(m, n, iters, hc_eps)


def _sinkhorn_vectors(m, n: int, iters: int, eps: float):
    """Sinkhorn of per-token logits m[j][k] (token vectors): row softmax + eps, then columns;
    then (rows, columns) iters - 1 times (§2.3 step 5). -> P[j][k]."""
    p = []
    for j in range(n):
        mx = functools.reduce(jnp.maximum, m[j])
        e = [jnp.exp(v - mx) for v in m[j]]
        s = functools.reduce(lambda a, b: a + b, e)
        p.append([v / s + eps for v in e])

    def cols(p):
        c = [functools.reduce(lambda a, b: a + b, [p[j][k] for j in range(n)]) + eps
             for k in range(n)]
        return [[p[j][k] / c[k] for k in range(n)] for j in range(n)]

    def rows(p):
        r = [functools.reduce(lambda a, b: a + b, p[j]) + eps for j in range(n)]
        return [[p[j][k] / r[j] for k in range(n)] for j in range(n)]

    flat = lambda p: tuple(v for r in p for v in r)
    unflat = lambda f: [list(f[n * j:n * j + n]) for j in range(n)]
    # A loop inside the kernel is free of launches: no need to unroll it.
    p = lax.fori_loop(0, iters - 1, lambda _, f: flat(cols(rows(unflat(f)))), flat(cols(p)))
    return unflat(p)


def _sinkhorn_call(lt, *, n: int, iters: int, eps: float, gates: bool = False):
    """lt [n*n, blocks * 64] fp32 (logits^T, token-minor) -> P^T, same layout; one CTA a
    64-token block, each token's n x n values as token vectors in registers.

    gates: lt holds all n * (n + 2) affine-mapped gate logits instead (rows pre 0:n, post
    n:2n, comb 2n:); the output is the gates in that layout: sigmoid + eps, 2 sigmoid and the
    Sinkhorn of the comb rows."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    rows, width = lt.shape
    first = 2 * n if gates else 0
    assert rows == first + n * n, (lt.shape, n, gates)
    row_l = plgpu.Layout.WGMMA.reduce(1)

    def body(l_ref, o_ref, l_smem, o_smem, bar):
        blk = lax.axis_index("b")
        plgpu.copy_gmem_to_smem(l_ref.at[:, pl.ds(blk * TOK, TOK)], l_smem, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
        load = lambda r: plgpu.load(l_smem.at[r], layout=row_l)
        m = [[load(first + n * j + k) for k in range(n)] for j in range(n)]
        p = _sinkhorn_vectors(m, n, iters, eps)
        for j in range(n):
            for k in range(n):
                o_smem.at[first + n * j + k][...] = p[j][k]
        if gates:
            for j in range(n):
                o_smem.at[j][...] = _sigmoid(load(j)) + eps
                o_smem.at[n + j][...] = 2.0 * _sigmoid(load(n + j))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[:, pl.ds(blk * TOK, TOK)])
        plgpu.wait_smem_to_gmem(0)

    def mhc_sinkhorn(l_ref, o_ref):
        pl.run_scoped(lambda *s: body(l_ref, o_ref, *s),
                      plgpu.SMEM((rows, TOK), jnp.float32), plgpu.SMEM((rows, TOK), jnp.float32),
                      plgpu.Barrier(num_barriers=1))

    def mhc_gates(l_ref, o_ref):        # the kernel's name in profiles
        mhc_sinkhorn(l_ref, o_ref)

    return plgpu.kernel(mhc_gates if gates else mhc_sinkhorn,
                        out_type=jax.ShapeDtypeStruct((rows, width), jnp.float32),
                        grid=(width // TOK,), grid_names=("b",))(lt)


_sinkhorn_kernel = lowered_once(_sinkhorn_call, "n", "iters", "eps", "gates")


def sinkhorn_layout(flat: jax.Array) -> jax.Array:
    """The Sinkhorn kernel's input layout: logits [N, n*n] -> [n*n, N rounded up to 64] fp32
    (token-minor, zero-padded)."""
    ntok = flat.shape[0]
    width = round_up(max(ntok, 1), TOK)
    return jnp.pad(flat.astype(jnp.float32).T, ((0, 0), (0, width - ntok)))


def sinkhorn_from_layout(lt: jax.Array, ntok: int, *, n: int, iters: int, eps: float,
                         interpret: bool = False) -> jax.Array:
    """The Sinkhorn kernel on logits in `sinkhorn_layout` -> P [ntok, n, n] fp32."""
    assert lt.shape[0] == n * n, (lt.shape, n)
    pt = _sinkhorn_kernel(lt, n=n, iters=iters, eps=eps, interpret=interpret)
    return pt[:, :ntok].T.reshape(ntok, n, n)


def sinkhorn_mgpu(logits, *, iters: int, eps: float, interpret: bool = False):
    """Registry signature of `sinkhorn`: logits [N, n, n] fp32 -> P [N, n, n] fp32."""
    ntok, n, _ = logits.shape
    if n * n > GATES:
        return sinkhorn(logits, iters, eps)
    return sinkhorn_from_layout(sinkhorn_layout(logits.reshape(ntok, n * n)), ntok, n=n,
                                iters=iters, eps=eps, interpret=interpret)


def _pairs(n: int) -> list[tuple[int, int]]:
    """The Gram matrix's upper-triangle entries (a <= b), in the kernels' order."""
    return [(a, b) for a in range(n) for b in range(a, n)]


def _mix_columns(acc_ref, x_ref, f_ref, *, n: int, nk: int, blk, first, count: int,
                 stages: int):
    """One token block's pipelined pass over 64-column steps [first, first + count) of each of
    the n streams (nk steps a stream): u^T [64 gate columns (hi, lo), TOK] += F_j^T X_j^T into
    the accumulator acc_ref; returns the Gram sums <X_a, X_b> over those columns (token
    vectors, `_pairs` order)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    wgmma_l = plgpu.Layout.WGMMA
    pairs = _pairs(n)
    bf16_t = _bf16_transforms()

    def step(_, *refs):
        *refs, carry = refs
        xs, fs = refs[:n], refs[n:]
        for j in range(n):
            plgpu.wgmma(acc_ref, fs[j].transpose((1, 0)), xs[j].transpose((1, 0)))
        xv = [plgpu.load(r, layout=wgmma_l).astype(jnp.float32) for r in xs]
        out = tuple(g + (xv[a] * xv[b]).sum(axis=1) for g, (a, b) in zip(carry, pairs))
        plgpu.wgmma_wait(0)
        return out

    zero = plgpu.layout_cast(jnp.zeros((TOK,), jnp.float32), wgmma_l.reduce(1))
    return plgpu.emit_pipeline(
        step, grid=(count,),
        in_specs=[plgpu.BlockSpec((TOK, COLS), lambda k, j=j: (blk, j * nk + first + k),
                                  transforms=bf16_t) for j in range(n)]
                 + [plgpu.BlockSpec((COLS, 2 * GATES), lambda k, j=j: (j * nk + first + k, 0),
                                    transforms=bf16_t) for j in range(n)],
        max_concurrent_steps=stages, init_carry=(zero,) * len(pairs),
    )(*([x_ref] * n), *([f_ref] * n))


def _gates_and_inv_rms(u_hi_lo, gram, scale_ref, base_ref, *, n: int, d: int, iters: int,
                       hc_eps: float, norm_eps: float):
    """Per token, from the mixing sums (2 * GATES token vectors: hi then lo halves) and the Gram
    sums (`_pairs` order): the gates (pre, post, comb) and the inverse RMS of the collapsed
    stream, sum_jk pre_j pre_k G[j,k] / D."""
    n_out = (2 + n) * n
    gram = dict(zip(_pairs(n), gram))
    ssq = functools.reduce(lambda a, b: a + b, [gram[(j, j)] for j in range(n)])
    inv_x = lax.rsqrt(ssq * (1.0 / (n * d)) + norm_eps)
    u = [(u_hi_lo[c] + u_hi_lo[GATES + c]) * inv_x for c in range(n_out)]
    pre, post, comb = _gates(u, [scale_ref[i] for i in range(3)],
                             [base_ref[c] for c in range(n_out)], n, iters, hc_eps)
    ssq_h = functools.reduce(lambda a, b: a + b, [
        (1.0 if a == b else 2.0) * pre[a] * pre[b] * gram[(a, b)] for a, b in gram])
    return pre, post, comb, lax.rsqrt(ssq_h * (1.0 / d) + norm_eps)


def _store_gates(g_smem, g_ref, blk, pre, post, comb):
    """gates^T columns of the token block: pre, post, then comb row-major."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    for c, v in enumerate(pre + post + [v for row in comb for v in row]):
        g_smem.at[c][...] = v
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(g_smem, g_ref.at[:, pl.ds(blk * TOK, TOK)])


def _collapse_columns(x_ref, w_ref, h_ref, o_smem, pre, inv_h, *, n: int, nk: int, blk, first,
                      count: int):
    """One token block's h = w * bf16(sum_j pre_j X_j) * inv_h over 64-column steps
    [first, first + count), pipelined, stored through the two slots of o_smem."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    wgmma_l = plgpu.Layout.WGMMA
    tshape = (TOK, COLS)
    bcast_rows = lambda v: lax.broadcast_in_dim(v, tshape, [0])
    pre_b = [bcast_rows(v) for v in pre]
    inv_h = bcast_rows(inv_h)

    def step(idx, *refs):
        xs, w_smem = refs[:n], refs[n]
        k = first + idx[0]
        slot = lax.rem(idx[0], 2)
        h = functools.reduce(lambda a, b: a + b, [
            pre_b[j] * plgpu.load(xs[j], layout=wgmma_l).astype(jnp.float32) for j in range(n)])
        w = plgpu.load(w_smem, layout=wgmma_l.reduce(0)).astype(jnp.float32)
        o = lax.broadcast_in_dim(w, tshape, [1]) * (_round(h, x_ref.dtype) * inv_h)
        # The store issued two steps ago read this slot: wait for it (one may stay).
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        o_smem.at[slot][...] = o.astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[slot],
                                h_ref.at[pl.ds(blk * TOK, TOK), pl.ds(k * COLS, COLS)])

    plgpu.emit_pipeline(
        step, grid=(count,),
        in_specs=[plgpu.BlockSpec(tshape, lambda k, j=j: (blk, j * nk + first + k),
                                  transforms=_bf16_transforms()) for j in range(n)]
                 + [plgpu.BlockSpec((COLS,), lambda k: (first + k,))],
        max_concurrent_steps=2,
    )(*([x_ref] * n), w_ref)
    plgpu.wait_smem_to_gmem(0)


def _pre_call(x2, fprep, norm_weight, base, scale, *, n: int, iters: int, hc_eps: float,
              norm_eps: float, stages: int):
    """x2 [N, n*D] bf16, fprep [n*D, 64] bf16 -> h [N, D] bf16, gates^T [n_out, blocks * 64]."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    ntok, nd = x2.shape
    d = nd // n
    nk = d // COLS
    n_out = (2 + n) * n
    nblk = -(-ntok // TOK)
    row_l = plgpu.Layout.WGMMA.reduce(1)
    kw = dict(n=n, d=d, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps)

    def mhc_pre_one(x_ref, f_ref, w_ref, base_ref, scale_ref, h_ref, g_ref):
        blk = lax.axis_index("b")

        def mix(acc_ref):
            gram = _mix_columns(acc_ref, x_ref, f_ref, n=n, nk=nk, blk=blk, first=0, count=nk,
                                stages=stages)
            return acc_ref[...], gram

        acc, gram = pl.run_scoped(mix, plgpu.ACC((2 * GATES, TOK), jnp.float32))

        def tail(u_smem, g_smem, o_smem):
            # u^T through shared memory: each gate column back as a token vector
            u_smem[...] = acc
            plgpu.commit_smem()
            u = [plgpu.load(u_smem.at[c], layout=row_l) if c % GATES < n_out else None
                 for c in range(2 * GATES)]
            pre, post, comb, inv_h = _gates_and_inv_rms(u, gram, scale_ref, base_ref, **kw)
            _store_gates(g_smem, g_ref, blk, pre, post, comb)
            _collapse_columns(x_ref, w_ref, h_ref, o_smem, pre, inv_h, n=n, nk=nk, blk=blk,
                              first=0, count=nk)

        pl.run_scoped(tail,
                      plgpu.SMEM((2 * GATES, TOK), jnp.float32),
                      plgpu.SMEM((n_out, TOK), jnp.float32),
                      plgpu.SMEM((2, TOK, COLS), x2.dtype, transforms=_bf16_transforms()))

    return plgpu.kernel(
        mhc_pre_one,
        out_type=(jax.ShapeDtypeStruct((ntok, d), x2.dtype),
                  jax.ShapeDtypeStruct((n_out, nblk * TOK), jnp.float32)),
        grid=(nblk,),
        grid_names=("b",),
    )(x2, fprep, norm_weight, base, scale)


_pre_kernel = lowered_once(_pre_call, "n", "iters", "hc_eps", "norm_eps", "stages")


def _mix_call(x2, fprep, *, n: int, splits: int, stages: int):
    """Split-D pass 1, grid (token blocks, splits): CTA (b, s) takes columns [s*per, (s+1)*per)
    of every stream. x2 [N, n*D] bf16, fprep [n*D, 64] bf16 -> partial u^T
    [splits, 2 * GATES, blocks * 64] and partial Gram sums [splits, pairs, blocks * 64], fp32."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    ntok, nd = x2.shape
    nk = nd // n // COLS
    per = nk // splits
    nblk = -(-ntok // TOK)
    npairs = len(_pairs(n))

    def mhc_pre_mix(x_ref, f_ref, u_ref, g_ref):
        blk, split = lax.axis_index("b"), lax.axis_index("s")

        def mix(acc_ref):
            gram = _mix_columns(acc_ref, x_ref, f_ref, n=n, nk=nk, blk=blk, first=split * per,
                                count=per, stages=stages)
            return acc_ref[...], gram

        acc, gram = pl.run_scoped(mix, plgpu.ACC((2 * GATES, TOK), jnp.float32))

        def store(u_smem, g_smem):
            u_smem[...] = acc
            for c, v in enumerate(gram):
                g_smem.at[c][...] = v
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(u_smem, u_ref.at[split, :, pl.ds(blk * TOK, TOK)])
            plgpu.copy_smem_to_gmem(g_smem, g_ref.at[split, :, pl.ds(blk * TOK, TOK)])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(store, plgpu.SMEM((2 * GATES, TOK), jnp.float32),
                      plgpu.SMEM((npairs, TOK), jnp.float32))

    return plgpu.kernel(
        mhc_pre_mix,
        out_type=(jax.ShapeDtypeStruct((splits, 2 * GATES, nblk * TOK), jnp.float32),
                  jax.ShapeDtypeStruct((splits, npairs, nblk * TOK), jnp.float32)),
        grid=(nblk, splits),
        grid_names=("b", "s"),
    )(x2, fprep)


def _tail_call(x2, part_u, part_g, norm_weight, base, scale, *, n: int, iters: int,
               hc_eps: float, norm_eps: float, col_splits: int):
    """Split-D pass 2, grid (token blocks, col_splits): each CTA sums the partials of its token
    block, computes the gates (Sinkhorn included) and collapses its share of the columns.
    -> h [N, D] bf16, gates^T [n_out, blocks * 64] fp32 (written by column split 0)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    ntok, nd = x2.shape
    d = nd // n
    nk = d // COLS
    per = nk // col_splits
    splits = part_u.shape[0]
    n_out = (2 + n) * n
    nblk = -(-ntok // TOK)
    npairs = len(_pairs(n))
    row_l = plgpu.Layout.WGMMA.reduce(1)
    kw = dict(n=n, d=d, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps)

    def mhc_pre_tail(x_ref, pu_ref, pg_ref, w_ref, base_ref, scale_ref, h_ref, g_ref):
        blk, split = lax.axis_index("b"), lax.axis_index("s")
        zero = plgpu.layout_cast(jnp.zeros((TOK,), jnp.float32), row_l)

        def add_step(_, u_smem, g_smem, carry):
            rows = [u_smem.at[0, r] for r in range(2 * GATES)] + \
                   [g_smem.at[0, r] for r in range(npairs)]
            return tuple(c + plgpu.load(r, layout=row_l) for r, c in zip(rows, carry))

        sums = plgpu.emit_pipeline(
            add_step, grid=(splits,),
            in_specs=[plgpu.BlockSpec((1, 2 * GATES, TOK), lambda s: (s, 0, blk)),
                      plgpu.BlockSpec((1, npairs, TOK), lambda s: (s, 0, blk))],
            max_concurrent_steps=2, init_carry=(zero,) * (2 * GATES + npairs),
        )(pu_ref, pg_ref)

        def tail(g_smem, o_smem):
            pre, post, comb, inv_h = _gates_and_inv_rms(sums[:2 * GATES], sums[2 * GATES:],
                                                        scale_ref, base_ref, **kw)

            @pl.when(split == 0)
            def _():
                _store_gates(g_smem, g_ref, blk, pre, post, comb)

            _collapse_columns(x_ref, w_ref, h_ref, o_smem, pre, inv_h, n=n, nk=nk, blk=blk,
                              first=split * per, count=per)

        pl.run_scoped(tail,
                      plgpu.SMEM((n_out, TOK), jnp.float32),
                      plgpu.SMEM((2, TOK, COLS), x2.dtype, transforms=_bf16_transforms()))

    return plgpu.kernel(
        mhc_pre_tail,
        out_type=(jax.ShapeDtypeStruct((ntok, d), x2.dtype),
                  jax.ShapeDtypeStruct((n_out, nblk * TOK), jnp.float32)),
        grid=(nblk, col_splits),
        grid_names=("b", "s"),
    )(x2, part_u, part_g, norm_weight, base, scale)


_mix_kernel = lowered_once(_mix_call, "n", "splits", "stages")
_tail_kernel = lowered_once(_tail_call, "n", "iters", "hc_eps", "norm_eps", "col_splits")


def choose_mix_splits(nblk: int, nk: int, num_sms: int = NUM_SMS) -> int:
    """Column splits of the pre side's first pass: the largest divisor of the per-stream step
    count that keeps at least two steps a CTA and at most one CTA an SM. 1 (the one-kernel
    path) when the token blocks alone fill the GPU."""
    best = 1
    for sp in range(1, nk // 2 + 1):
        if nk % sp == 0 and nblk * sp <= num_sms:
            best = sp
    return best


# Token count from which wide streams take the split-D pair of kernels: below it (decode) the
# pair's partial sums cost more latency than XLA's projection, and the pre side runs in XLA
# with the gates kernel ("hybrid").
SPLIT_MIN_TOKENS = 2048


def _hybrid_gates(streams, fn, base, scale, *, n: int, iters: int, hc_eps: float,
                  norm_eps: float, interpret: bool):
    """The pre side's gates in XLA + one kernel: gates^T [n * (n + 2), N rounded up to 64]
    (pre 0:n, post n:2n, comb 2n:), as the other paths' kernels write them.

    The projection reads the streams as they are and the RMS factor scales its n_out columns
    after it (the reference scales the n * D inputs before: equal up to fp32 rounding), so
    the normalised streams are never written out; the affine map writes the logits in the
    kernel's layout, and the kernel takes the sigmoids and the Sinkhorn."""
    ntok = streams.shape[0]
    x = streams.reshape(ntok, -1).astype(jnp.float32)
    inv_rms = lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + norm_eps)
    u = jnp.matmul(x, fn.astype(jnp.float32), precision=lax.Precision.HIGHEST) * inv_rms
    gate_scale = jnp.concatenate([jnp.broadcast_to(scale[i], (w,))
                                  for i, w in enumerate((n, n, n * n))])
    lt = lax.optimization_barrier(sinkhorn_layout(gate_scale * u + base))
    return _sinkhorn_kernel(lt, n=n, iters=iters, eps=hc_eps, gates=True, interpret=interpret)


def choose_pre_path(ntok: int, n: int, d: int) -> str:
    """"one" (one kernel: narrow streams, many tokens), "split" (two kernels: wide streams,
    many tokens) or "hybrid" (XLA and the gates kernel: fewer tokens)."""
    if n * d <= PREFER_MAX_STREAM_WIDTH:
        return "one" if ntok >= ONE_KERNEL_MIN_TOKENS else "hybrid"
    return "split" if ntok >= SPLIT_MIN_TOKENS else "hybrid"


def mhc_pre_mgpu(streams, fn, base, scale, norm_weight, *, iters: int, hc_eps: float,
                 norm_eps: float, interpret: bool = False, stages: int = 3,
                 path: str | None = None, splits: int | None = None):
    """Registry signature of `mhc_pre`; unsupported inputs go to the XLA reference.

    path: "one" | "split" | "hybrid" (default `choose_pre_path`); splits: the split-D path's
    column splits (default `choose_mix_splits`)."""
    if not supported(streams):
        pre, post, comb = mhc_weights(streams, fn, base, scale, n=streams.shape[-2],
                                      iters=iters, hc_eps=hc_eps, norm_eps=norm_eps)
        return rms_norm(collapse(streams, pre), norm_weight, norm_eps), post, comb
    ntok, n, d = streams.shape
    path = path or choose_pre_path(ntok, n, d)
    base, scale = base.astype(jnp.float32), scale.astype(jnp.float32)
    x2 = _pad_tokens(streams.reshape(ntok, n * d)) if path != "hybrid" else None
    nblk, nk = -(-ntok // TOK), d // COLS
    if path == "hybrid":
        gt = _hybrid_gates(streams, fn, base, scale, n=n, iters=iters, hc_eps=hc_eps,
                           norm_eps=norm_eps, interpret=interpret)
        h = rms_norm(collapse(streams, gt[:n, :ntok].T), norm_weight, norm_eps)
    elif path == "one":
        h, gt = _pre_kernel(x2, prepare_fn(fn), norm_weight, base, scale, n=n, iters=iters,
                            hc_eps=hc_eps, norm_eps=norm_eps, stages=stages,
                            interpret=interpret)
    elif path == "split":
        if splits is None:
            splits = choose_mix_splits(nblk, nk, 4 if interpret else NUM_SMS)
        if nk % splits:
            raise ValueError(f"mhc_pre_mgpu: splits={splits} does not divide D/64={nk}")
        part_u, part_g = _mix_kernel(x2, prepare_fn(fn), n=n, splits=splits,
                                     stages=min(stages, nk // splits), interpret=interpret)
        h, gt = _tail_kernel(x2, part_u, part_g, norm_weight, base, scale, n=n, iters=iters,
                             hc_eps=hc_eps, norm_eps=norm_eps,
                             col_splits=choose_splits(nblk, nk, 4 if interpret else NUM_SMS),
                             interpret=interpret)
    else:
        raise ValueError(f"mhc_pre_mgpu: path {path!r} is not one of 'one', 'split', 'hybrid'")
    # Transposed back here; mhc_post_mgpu transposes again, and XLA cancels the pair (the XLA
    # post side reads per-token slices, which need no transpose either).
    post = gt[n:2 * n, :ntok].T
    comb = gt[2 * n:, :ntok].T.reshape(ntok, n, n)
    return h[:ntok], post, comb


def choose_splits(nblk: int, nk: int, num_sms: int = NUM_SMS) -> int:
    """Column splits of the post side: the largest divisor of the step count with at most
    two CTAs an SM."""
    best = 1
    for sp in range(1, nk + 1):
        if nk % sp == 0 and nblk * sp <= 2 * num_sms:
            best = sp
    return best


def _post_call(x2, y, gt, *, n: int, splits: int):
    """x2 [N, n*D] bf16, y [N, D], gt [n + n*n, blocks * 64] fp32 (post^T, comb^T) -> [N, n*D]."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    ntok, nd = x2.shape
    d = nd // n
    nk = d // COLS
    per = nk // splits
    nblk = -(-ntok // TOK)
    dtype = x2.dtype
    wgmma_l = plgpu.Layout.WGMMA
    row_l = wgmma_l.reduce(1)
    bf16_t = _bf16_transforms()
    tshape = (TOK, COLS)

    def body(x_ref, y_ref, g_ref, o_ref, g_smem, o_smem, bar):
        blk = lax.axis_index("b")
        split = lax.axis_index("s")
        plgpu.copy_gmem_to_smem(g_ref.at[:, pl.ds(blk * TOK, TOK)], g_smem, bar.at[0])
        plgpu.barrier_wait(bar.at[0])

        def gate(c):   # rounded to the stream dtype, as the reference feeds it
            v = _round(plgpu.load(g_smem.at[c], layout=row_l), dtype)
            return lax.broadcast_in_dim(v, tshape, [0])

        post = [gate(k) for k in range(n)]
        comb = [[gate(n + n * j + k) for k in range(n)] for j in range(n)]
        base = split * per

        def step(idx, *refs):
            xs, y_smem = refs[:n], refs[n]
            k = base + idx[0]
            slot = lax.rem(idx[0], 2)
            xv = [plgpu.load(r, layout=wgmma_l).astype(jnp.float32) for r in xs]
            yv = plgpu.load(y_smem, layout=wgmma_l).astype(jnp.float32)
            # The n stores issued two steps ago read this slot: wait for them.
            plgpu.wait_smem_to_gmem(n, wait_read_only=True)
            for kk in range(n):
                mixed = functools.reduce(lambda a, b: a + b,
                                         [comb[j][kk] * xv[j] for j in range(n)])
                out = _round(post[kk] * yv, dtype) + _round(mixed, dtype)
                o_smem.at[slot, kk][...] = out.astype(dtype)
            plgpu.commit_smem()
            for kk in range(n):
                plgpu.copy_smem_to_gmem(
                    o_smem.at[slot, kk],
                    o_ref.at[pl.ds(blk * TOK, TOK), pl.ds((kk * nk + k) * COLS, COLS)])

        plgpu.emit_pipeline(
            step, grid=(per,),
            in_specs=[plgpu.BlockSpec(tshape, lambda k, j=j: (blk, j * nk + base + k),
                                      transforms=bf16_t) for j in range(n)]
                     + [plgpu.BlockSpec(tshape, lambda k: (blk, base + k), transforms=bf16_t)],
            max_concurrent_steps=2,
        )(*([x_ref] * n), y_ref)
        plgpu.wait_smem_to_gmem(0)

    def mhc_post(x_ref, y_ref, g_ref, o_ref):
        pl.run_scoped(
            lambda *s: body(x_ref, y_ref, g_ref, o_ref, *s),
            plgpu.SMEM((gt.shape[0], TOK), jnp.float32),
            plgpu.SMEM((2, n, TOK, COLS), dtype, transforms=bf16_t),
            plgpu.Barrier(num_barriers=1),
        )

    return plgpu.kernel(
        mhc_post,
        out_type=jax.ShapeDtypeStruct((ntok, nd), dtype),
        grid=(nblk, splits),
        grid_names=("b", "s"),
    )(x2, y, gt)


_post_kernel = lowered_once(_post_call, "n", "splits")


def mhc_post_mgpu(streams, y, post, comb, *, interpret: bool = False,
                  splits: int | None = None):
    """Registry signature of `mhc_post`; unsupported inputs go to the XLA reference."""
    if not supported(streams):
        return expand(streams, y, post, comb)
    ntok, n, d = streams.shape
    nk = d // COLS
    nblk = -(-ntok // TOK)
    if splits is None:
        splits = choose_splits(nblk, nk, 4 if interpret else NUM_SMS)
    gt = jnp.concatenate([post.astype(jnp.float32).T,
                          comb.astype(jnp.float32).reshape(ntok, n * n).T], axis=0)
    gt = jnp.pad(gt, ((0, 0), (0, nblk * TOK - ntok)))
    out = _post_kernel(_pad_tokens(streams.reshape(ntok, n * d)),
                       _pad_tokens(y.astype(streams.dtype)), gt, n=n, splits=splits,
                       interpret=interpret)
    return out[:ntok].reshape(ntok, n, d)


mhc_pre_mgpu.available = on_hopper
mhc_post_mgpu.available = on_hopper
sinkhorn_mgpu.available = on_hopper
