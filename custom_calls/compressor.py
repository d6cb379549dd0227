"""Fused compressor decode step for Hopper in Pallas Mosaic GPU (`compressor_decode`/`mosaic_gpu`).

Contract: deepinfer_fn.kernels.compressor_decode (one new token, every compressor of a layer:
CSA has the main and the indexer compressor, HCA the main one; spec §2.6, §2.7 step 1).

Structure (one Pallas kernel for all compressors of the layer, then one small XLA fusion):
1. XLA (tiny): per batch row and ring slot s, the role of the position the slot holds
   (p_s = the last position < `position` with p_s = s mod R): an A-candidate (window w-1,
   CSA only), a B-candidate (window w, positions < `position`) or nothing; the current token's
   multiplicity (it stands in for the window's positions >= `position`, as the XLA reference
   reads them); the ape rows ape[position % m].
2. Pallas kernel, grid (channel tiles of all compressors, batch blocks of 64 rows). A CTA
   owns `tn` channels of one compressor's row, i.e. the kv/gate columns of those channels
   (A and B halves for CSA): it streams x @ wkv / x @ wgate over D through shared memory
   (TMA pipeline, wgmma, fp32 accumulators; the wgmma M = 64 batch rows, TMA zero-fills
   rows past B), writes the token's ring entries (kappa, gate + ape), then streams the
   layer's ring tiles of those columns slot by slot and pools them with the token by a
   per-channel online softmax (fp32). A long ring window (HCA) is split over `splits` CTAs
   per tile, each writing a partial (max, denominator, numerator).
3. XLA: the splits merged, RMSNorm over the row and compress RoPE (they need the whole row,
   which spans CTAs).

Not chosen by the registry on its own (`available()` is False): the projection runs on only
sum(d) / tn CTAs, each streaming all of D, which is latency-bound at decode shapes; the
XLA reference was faster on an H200. Next step: split D over more CTAs (a cluster reducing
the partial projections in distributed shared memory) before the pooling.

Numerics: the XLA reference rounds the softmax weights to the activation dtype before the
weighted sum; the kernel keeps them in fp32 (online softmax), so the pooled rows agree to the
activation dtype's rounding, not bit for bit. The ring entries (kappa, gate) are rounded as
the reference's; on a GPU they can differ from XLA's by one bf16 ulp (another fp32
accumulation order).

Supported: bf16 / fp16 weights and ring, fp32 ring gates, every d a multiple of `tn`, D a
multiple of `block_k`, all rings with the same slot count R. Anything else falls back to the
XLA reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from custom_calls._common import lowered_once, round_up
from deepinfer_fn import kernels_xla

_ROWS = 64          # wgmma M: batch rows of one CTA
_BIG = 1e30         # "minus infinity" of the online softmax (finite: no inf - inf)
_SMEM_BYTES = 200 * 1024        # shared memory a CTA may use (H100 / H200: 227 KiB)


def _smem_transforms(dtype, cols: int):
    """Tiling + swizzle for a [rows, cols] shared-memory tile read by wgmma / in WGMMA layout."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    item = jnp.dtype(dtype).itemsize
    swizzle = min(128, cols * item)
    return (plgpu.TilingTransform((8, swizzle // item)), plgpu.SwizzleTransform(swizzle))


def _kernel_call(x, role_a, role_b, mult, comps, *, dims, overlaps, tn: int, block_k: int,
                 stages: int, splits: int):
    """x [B, D]; role_a/role_b [R, Bp] f32 (0/1); mult [1, Bp] f32 (Bp = B rounded up to
    the 64-row block: TMA zero-fills the x and ring rows past B); comps: per compressor
    (wkv [D, W], wgate [D, W], ape_rows [Bp, W] f32, ring_kv [B, R*W], ring_gate [B, R*W] f32).
    Returns per compressor (kappa [Bp, W], gate [Bp, W] f32, partial softmax states
    [3, splits, Bp, d] f32: running max, denominator, numerator of each slot split)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    d_model = x.shape[1]
    bp = role_a.shape[1]
    n_slots = role_a.shape[0]
    chunk = n_slots // splits
    assert chunk * splits == n_slots, (n_slots, splits)
    dtype = x.dtype
    f32 = jnp.float32
    nb = bp // _ROWS
    k_steps = d_model // block_k
    tiles = [d // tn for d in dims]
    first = [sum(tiles[:i]) for i in range(len(dims))]
    h_tf, f_tf = _smem_transforms(dtype, tn), _smem_transforms(f32, tn)
    x_tf = h_tf                      # wgmma wants one swizzle for both operands
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    n_in = 4 + 5 * len(dims)
    staging_bytes = 2 * _ROWS * tn * (jnp.dtype(dtype).itemsize + 8) + 3 * _ROWS * tn * 4 + 4 * _ROWS

    def one(i, t, bb, sp, x_ref, ra_ref, rb_ref, mult_ref, ins, outs, scoped):
        wkv, wgate, ape, ring_kv, ring_gate = ins
        o_kv, o_gate, o_part = outs
        kv_s, g_s, ape_s, part_s, mult_s, bars = scoped
        dim, width = dims[i], (2 if overlaps[i] else 1) * dims[i]
        per_slot = width // tn
        cols = [t, dim // tn + t] if overlaps[i] else [t]     # column blocks: [A,] B
        nh = len(cols)
        rows = pl.ds(bb * _ROWS, _ROWS)
        proj_bytes = (_ROWS + 2 * nh * tn) * block_k * jnp.dtype(dtype).itemsize
        proj_stages = max(2, min(stages, k_steps, (_SMEM_BYTES - staging_bytes) // proj_bytes))

        @pl.when(sp == 0)
        def _project():
            # Side inputs (ape rows, the token's multiplicity), in flight during the GEMM.
            for h, cb in enumerate(cols):
                plgpu.copy_gmem_to_smem(ape.at[rows, pl.ds(cb * tn, tn)], ape_s.at[h],
                                        bars.at[h])
            plgpu.copy_gmem_to_smem(mult_ref.at[:, rows], mult_s, bars.at[2])

            # 1. kappa / gate columns of this tile: x @ w over D, fp32 accumulators.
            def proj_scope(*accs):
                def step(_, x_smem, *w_smem):
                    for acc, w in zip(accs, w_smem):
                        plgpu.wgmma(acc, x_smem, w)
                    plgpu.wgmma_wait(len(accs))

                w_specs = [plgpu.BlockSpec((block_k, tn), lambda k, cb=cb: (k, cb),
                                           transforms=h_tf, delay_release=1)
                           for _ in range(2) for cb in cols]
                plgpu.emit_pipeline(
                    step, grid=(k_steps,),
                    in_specs=[plgpu.BlockSpec((_ROWS, block_k), lambda k: (bb, k),
                                              transforms=x_tf, delay_release=1)] + w_specs,
                    max_concurrent_steps=proj_stages,
                )(x_ref, *([wkv] * nh), *([wgate] * nh))
                return tuple(a[...] for a in accs)

            accs = pl.run_scoped(proj_scope, *[plgpu.ACC((_ROWS, tn), f32)] * (2 * nh))

            # 2. The token's ring entries: kappa in the activation dtype, gate rounded like
            # the reference's projection (weight dtype) then + ape in fp32.
            for h, cb in enumerate(cols):
                plgpu.barrier_wait(bars.at[h])
                kv_s.at[h][...] = accs[h].astype(dtype)
                g_s.at[h][...] = (accs[nh + h].astype(dtype).astype(f32)
                                  + plgpu.load(ape_s.at[h], layout=wgmma_layout))
            plgpu.commit_smem()
            for h, cb in enumerate(cols):
                plgpu.copy_smem_to_gmem(kv_s.at[h], o_kv.at[rows, pl.ds(cb * tn, tn)])
                plgpu.copy_smem_to_gmem(g_s.at[h], o_gate.at[rows, pl.ds(cb * tn, tn)])

        # 3. Pool: online softmax per channel over this split's ring slots (and the token).
        def add(carry, g, kv, r):
            mx, den, num = carry
            rb = lax.broadcast_in_dim(r, g.shape, [0])
            gm = g * rb + (rb - 1.0) * _BIG
            m_new = jnp.maximum(mx, gm)
            alpha = jnp.exp(mx - m_new)
            e = rb * jnp.exp(gm - m_new)
            return m_new, den * alpha + e, num * alpha + e * kv

        def ring_step(idx, *refs):
            *tile_refs, carry = refs
            kv_refs, g_refs, r_refs = tile_refs[:nh], tile_refs[nh:2 * nh], tile_refs[2 * nh:]
            for h in range(nh):
                r = plgpu.load(r_refs[h].at[0], layout=row_layout)
                g = plgpu.load(g_refs[h], layout=wgmma_layout)
                kv = plgpu.load(kv_refs[h], layout=wgmma_layout).astype(f32)
                carry = add(carry, g, kv, r)
            return carry

        slot0 = sp * chunk
        ring_specs = ([plgpu.BlockSpec((_ROWS, tn),
                                       lambda s, cb=cb: (bb, (slot0 + s) * per_slot + cb),
                                       transforms=h_tf) for cb in cols]
                      + [plgpu.BlockSpec((_ROWS, tn),
                                         lambda s, cb=cb: (bb, (slot0 + s) * per_slot + cb),
                                         transforms=f_tf) for cb in cols]
                      + [plgpu.BlockSpec((1, _ROWS), lambda s: (slot0 + s, bb))
                         for _ in range(nh)])
        role_refs = [ra_ref, rb_ref] if nh == 2 else [rb_ref]
        init = (plgpu.layout_cast(jnp.full((_ROWS, tn), -_BIG, f32), wgmma_layout),
                plgpu.layout_cast(jnp.full((_ROWS, tn), 0.0, f32), wgmma_layout),
                plgpu.layout_cast(jnp.full((_ROWS, tn), 0.0, f32), wgmma_layout))
        stage_bytes = nh * (_ROWS * tn * (jnp.dtype(dtype).itemsize + 4) + 4 * _ROWS)
        ring_stages = max(1, min(chunk, (_SMEM_BYTES - staging_bytes) // stage_bytes))
        carry = plgpu.emit_pipeline(
            ring_step, grid=(chunk,), in_specs=ring_specs,
            max_concurrent_steps=ring_stages, init_carry=init,
        )(*([ring_kv] * nh), *([ring_gate] * nh), *role_refs)

        def store(carry):
            for k, v in enumerate(carry):
                part_s.at[k][...] = v
            plgpu.commit_smem()
            for k in range(3):
                plgpu.copy_smem_to_gmem(part_s.at[k], o_part.at[k, sp, rows, pl.ds(t * tn, tn)])

        @pl.when(sp == 0)
        def _with_token():       # the B half of the token, standing for `mult` positions
            plgpu.barrier_wait(bars.at[2])
            mult_v = plgpu.load(mult_s.at[0], layout=row_layout)
            mx, den, num = carry
            g = plgpu.load(g_s.at[nh - 1], layout=wgmma_layout)
            kv = plgpu.load(kv_s.at[nh - 1], layout=wgmma_layout).astype(f32)
            mb = lax.broadcast_in_dim(mult_v, g.shape, [0])
            m_new = jnp.maximum(mx, g)
            alpha = jnp.exp(mx - m_new)
            e = mb * jnp.exp(g - m_new)
            store((m_new, den * alpha + e, num * alpha + e * kv))

        if splits > 1:
            @pl.when(sp != 0)
            def _ring_only():
                store(carry)
        plgpu.wait_smem_to_gmem(0)

    def compressor_decode(*refs):
        x_ref, ra_ref, rb_ref, mult_ref = refs[:4]
        ins = [refs[4 + 5 * i: 9 + 5 * i] for i in range(len(dims))]
        outs = [refs[n_in + 3 * i: n_in + 3 * i + 3] for i in range(len(dims))]
        tile = lax.axis_index("tile")
        bb = lax.axis_index("bb")
        sp = lax.axis_index("split")

        def scoped_body(*scoped):
            for i in range(len(dims)):
                @pl.when((tile >= first[i]) & (tile < first[i] + tiles[i]))
                def _(i=i):
                    one(i, tile - first[i], bb, sp, x_ref, ra_ref, rb_ref, mult_ref, ins[i],
                        outs[i], scoped)

        pl.run_scoped(
            scoped_body,
            plgpu.SMEM((2, _ROWS, tn), dtype, transforms=h_tf),     # kappa halves
            plgpu.SMEM((2, _ROWS, tn), f32, transforms=f_tf),       # gate halves
            plgpu.SMEM((2, _ROWS, tn), f32, transforms=f_tf),       # ape halves
            plgpu.SMEM((3, _ROWS, tn), f32, transforms=f_tf),       # max, den, num
            plgpu.SMEM((1, _ROWS), f32),                            # multiplicity
            plgpu.Barrier(num_barriers=3),
        )

    out_type = []
    for d, ov in zip(dims, overlaps):
        width = (2 if ov else 1) * d
        out_type += [jax.ShapeDtypeStruct((bp, width), dtype), jax.ShapeDtypeStruct((bp, width), f32),
                     jax.ShapeDtypeStruct((3, splits, bp, d), f32)]
    flat = [a for c in comps for a in c]
    res = plgpu.kernel(
        compressor_decode, out_type=tuple(out_type), grid=(sum(tiles), nb, splits),
        grid_names=("tile", "bb", "split"),
    )(x, role_a, role_b, mult, *flat)
    return [tuple(res[3 * i: 3 * i + 3]) for i in range(len(dims))]


_kernel = lowered_once(_kernel_call, "dims", "overlaps", "tn", "block_k", "stages", "splits")


def merge_splits(parts, dtype):
    """[3, splits, B, d] partial (max, den, num) -> pooled [B, d] in dtype."""
    mx, den, num = parts[0], parts[1], parts[2]
    top = mx.max(axis=0)
    w = jnp.exp(mx - top[None])
    return ((num * w).sum(0) / jnp.maximum((den * w).sum(0), 1e-30)).astype(dtype)


def default_splits(n_slots: int, target: int = 8) -> int:
    """Slot splits (CTAs sharing one tile's ring window): the largest divisor of R that is
    at most `target`, when the window is long (HCA); 1 for short rings (CSA)."""
    if n_slots < 32:
        return 1
    return max(s for s in range(1, target + 1) if n_slots % s == 0)


def slot_roles(position, n_slots: int, ratio: int):
    """Per batch row b and ring slot s (fp32 0/1, [R, B]): whether the position p_s the slot
    holds (the last p < position with p = s mod R) is an A-candidate (window w-1) / a
    B-candidate (window w, p < position) of the row of window w = position // m; and the
    token's multiplicity [1, B]: the window's positions >= position, all read as the token."""
    m = ratio
    pos = position.astype(jnp.int32)[:, None]
    lo = (pos // m) * m
    p_s = pos - 1 - (pos - 1 - jnp.arange(n_slots, dtype=jnp.int32)[None]) % n_slots
    role_b = (p_s >= lo) & (p_s >= 0)
    role_a = (p_s >= lo - m) & (p_s < lo) & (p_s >= 0)
    mult = (lo + m - pos).T
    return role_a.T.astype(jnp.float32), role_b.T.astype(jnp.float32), mult.astype(jnp.float32)


def supported(x, params, rings, tn: int, block_k: int) -> bool:
    ok_dtype = (jnp.bfloat16, jnp.float16)
    slots = {r[0].shape[1] for r in rings}
    return (x.shape[1] % block_k == 0 and len(slots) == 1
            and all(p["wkv"].dtype in ok_dtype and p["wgate"].dtype == p["wkv"].dtype
                    and kv.dtype == p["wkv"].dtype and g.dtype == jnp.float32
                    and p["norm"].shape[0] % tn == 0
                    and p["wkv"].shape[1] in (p["norm"].shape[0], 2 * p["norm"].shape[0])
                    for p, (kv, g) in zip(params, rings)))


def compressor_decode_mgpu(x, position, params, rings, ratio, freqs, eps, *,
                           interpret: bool = False, tn: int = 32, block_k: int = 64,
                           stages: int = 4, splits: int | None = None):
    if not supported(x, params, rings, tn, block_k):
        return kernels_xla.compressor_decode(x, position, params, rings, ratio, freqs, eps)
    b, _ = x.shape
    bp = round_up(b, _ROWS)
    dtype = params[0]["wkv"].dtype
    n_slots = rings[0][0].shape[1]
    splits = default_splits(n_slots) if splits is None else splits
    if n_slots % splits:
        raise ValueError(f"compressor_decode: splits={splits} does not divide R={n_slots}")
    pos = position.astype(jnp.int32)
    pad = lambda a: jnp.pad(a, ((0, 0), (0, bp - b)))
    role_a, role_b, mult = map(pad, slot_roles(pos, n_slots, ratio))
    comps = []
    for p, (kv, g) in zip(params, rings):
        width = p["wkv"].shape[1]
        ape_rows = jnp.pad(p["ape"].astype(jnp.float32)[pos % ratio], ((0, bp - b), (0, 0)))
        comps.append((p["wkv"], p["wgate"], ape_rows, kv.reshape(b, n_slots * width),
                      g.reshape(b, n_slots * width)))
    dims = tuple(p["norm"].shape[0] for p in params)
    overlaps = tuple(p["wkv"].shape[1] == 2 * d for p, d in zip(params, dims))
    res = _kernel(x.astype(dtype), role_a, role_b, mult, comps, dims=dims, overlaps=overlaps,
                  tn=tn, block_k=block_k, stages=stages, splits=splits, interpret=interpret)
    out = []
    for p, (kappa, gate, parts) in zip(params, res):
        pooled = merge_splits(parts[:, :, :b], dtype)
        out.append((kappa[:b], gate[:b],
                    kernels_xla.compressor_row_finish(p, pooled, pos, ratio, freqs, eps)))
    return tuple(out)


def available() -> bool:
    """Never chosen by the registry on its own: at decode shapes on an H200 the kernel ran
    slower than the XLA reference (benchmarks/topk_compressor.py; its few CTAs, one per
    `tn` channels, each stream D serially). Force it with
    DEEPINFER_KERNELS=compressor_decode=mosaic_gpu."""
    return False


compressor_decode_mgpu.available = available
