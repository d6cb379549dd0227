"""Kernel benchmark on one GPU: XLA reference vs Pallas Mosaic GPU (custom_calls/).

    PYTHONUNBUFFERED=1 python3 benchmarks/kernels.py --out benchmarks/results

(a) grouped_matmul for the `mini` preset's MoE (hidden 2048, moe_intermediate 512, 64 experts,
    top-6) at decode (tokens 1, 16, 64: M = 6 * tokens) and prefill (tokens 4096), both
    w1 (2048 -> 512) and w2 (512 -> 2048).
(b) sparse_attention decode: B = 1, 16, 64, S = 1, H = 32, d = 512, Wk = 128, K = 512 rows
    selected from N = 4096 compressed rows a sequence.
(c) chunk_attention, `mini`'s prefill chunks from an empty state (1 x 4096 and 8 x 512; H = 32,
    d = 512, window 128): SWA (window only), HCA (+ every visible row of ratio 128) and CSA
    (+ a top-512 selection of the visible rows of ratio 4). FLOPs counted are those of the
    visible keys (4 H d a query-key pair), as a dense flash kernel with masks does no less.
(d) index_scores, `mini`'s CSA indexer over a prefill chunk (1 x 4096 tokens x 1024 rows,
    8 x 512 x 128; 32 heads of 128).

Each case is checked against the XLA reference first (relative Frobenius error, NaNs), then
timed: compile and warm up, then the median (and 10th / 90th percentiles) of many
iterations of GPU time as CUPTI reports it (the sum of the kernels one call launches: host
dispatch excluded), rotating over several input sets so that the L2 cache (60 MB) does not
hold the weights / rows between iterations. Falls back to wall clock around
block_until_ready when CUPTI is unavailable (the JSON says which).
Ceilings measured in the same run: HBM bandwidth by a large on-device copy (bytes read +
written), bf16 matrix rate by an 8192^3 product. Bytes counted are those that must move:
each input read once (for grouped_matmul only the experts that receive rows), each output
written once.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import platform
import statistics
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from deepinfer_fn import kernels, kernels_xla  # noqa: E402

from custom_calls import chunk_attention as ca_mod  # noqa: E402
from custom_calls import grouped_matmul as gmm_mod  # noqa: E402
from custom_calls import indexer as idx_mod  # noqa: E402
from custom_calls import sparse_attention as sa_mod  # noqa: E402

HIDDEN, INTER, EXPERTS, TOPK = 2048, 512, 64, 6
RESULTS: dict = {"cases": [], "errors": [], "checks": []}
SPARSE = dict(h=32, d=512, wk=128, k=512)
GROUPED_TOKENS = (1, 16, 64, 4096)
SPARSE_BATCH = (1, 16, 64)
DRY: dict = {}  # --dry: tiny shapes, kernels in GPU interpret mode, wall clock (plumbing test on CPU)


def log(*a):
    print(*a, flush=True)


# ------------------------------------------------------------------ timing
_CUPTI_OK = [True]


def bench(f, arg_sets, iters=40):
    if DRY:
        iters = 2
    """Median GPU time (µs) of f over rotating argument sets, with p10 / p90."""
    jf = jax.jit(f)
    for a in arg_sets:
        jax.block_until_ready(jf(*a))
    t0 = time.perf_counter()
    for a in arg_sets:
        jax.block_until_ready(jf(*a))
    per_call = (time.perf_counter() - t0) / len(arg_sets)
    iters = int(max(DRY.get("iters", 5), min(iters, 1.5 / max(per_call, 1e-6))))  # cap ~1.5 s
    times, method = [], "cupti"
    if _CUPTI_OK[0] and not DRY:
        try:
            from jax.experimental.mosaic.gpu import profiler
            meas = profiler.measure(jf)
            for i in range(iters):
                out, t = meas(*arg_sets[i % len(arg_sets)])
                if t is None:
                    raise RuntimeError("CUPTI saw no kernel")
                times.append(t * 1e3)
        except Exception as e:  # noqa: BLE001
            log(f"  CUPTI timing failed ({type(e).__name__}: {e}); wall clock from now on")
            _CUPTI_OK[0] = False
            times = []
    if not times:
        method = "wallclock"
        for i in range(iters):
            a = arg_sets[i % len(arg_sets)]
            t0 = time.perf_counter()
            jax.block_until_ready(jf(*a))
            times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    n = len(times)
    res = {"us": statistics.median(times), "p10": times[n // 10], "p90": times[(9 * n) // 10],
           "iters": n, "timing": method}
    if method == "cupti":
        try:  # one call's kernels, by name (us)
            from jax.experimental.mosaic.gpu import profiler
            _, ks = profiler.measure(jf, aggregate=False)(*arg_sets[0])
            res["kernels"] = [(name[:80], t * 1e3) for name, t in ks]
        except Exception:  # noqa: BLE001
            pass
    return res


def _interp():
    return {"interpret": True} if DRY else {}


def rel_err(got, want):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    nan = int(np.isnan(got).sum())
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)), nan


def check(name, got, want, tol=1e-2, extra=None):
    err, nan = rel_err(got, want)
    ok = nan == 0 and err < tol
    rec = {"name": name, "rel_err": err, "nans": nan, "ok": bool(ok), **(extra or {})}
    RESULTS["checks"].append(rec)
    log(f"  check {name}: rel_err={err:.2e} nans={nan} {'OK' if ok else 'FAIL'}")
    return ok


def failed(where: str, e: Exception):
    """Log an exception of one case and keep it (with its traceback) in the results."""
    log(f"!! {where} failed: {type(e).__name__}: {str(e)[:1500]}")
    RESULTS["errors"].append({"where": where, "error": f"{type(e).__name__}: {e}"[:4000],
                              "traceback": traceback.format_exc()[-6000:]})


def guarded(label):
    def deco(fn):
        @functools.wraps(fn)
        def run(*a, **k):
            t0 = time.time()
            try:
                return fn(*a, **k)
            except Exception as e:  # noqa: BLE001
                failed(label, e)
            finally:
                log(f"  [{label}: {time.time() - t0:.1f}s]")
        return run
    return deco


# ------------------------------------------------------------------ ceilings
@guarded("peaks")
def peaks():
    shape = (1024, 1024) if DRY else (49152, 32768)  # 3 GiB of bf16: 6 GiB moved a copy
    n = shape[0] * shape[1]
    x = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
    r = bench(lambda a: a + jnp.bfloat16(1), [(x,)], iters=20)
    bw = 2 * n * 2 / (r["us"] * 1e-6) / 1e12
    del x
    mm = 256 if DRY else 8192
    a = jax.random.normal(jax.random.key(1), (mm, mm), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (mm, mm), jnp.bfloat16)
    rm = bench(lambda p, q: p @ q, [(a, b)], iters=20)
    tf = 2 * mm ** 3 / (rm["us"] * 1e-6) / 1e12
    RESULTS["peaks"] = {"hbm_copy_TBps": bw, "jax_elementwise_copy_TBps": bw, "copy_us": r["us"],
                        "bf16_matmul_TFLOPs": tf, "matmul_us": rm["us"], "timing": r["timing"]}
    log(f"peaks: JAX x+1 copy {bw:.2f} TB/s ({r['us']:.0f} us for {4 * n / 2**30:.1f} GiB moved), "
        f"bf16 {mm}^3 matmul {tf:.0f} TFLOP/s")
    if DRY:
        return
    try:  # the same copy through PyTorch's copy kernel, timed with CUDA events
        import torch
        ta = torch.randn(n, dtype=torch.bfloat16, device="cuda")
        tb = torch.empty_like(ta)
        for _ in range(3):
            tb.copy_(ta)
        ts = []
        for _ in range(20):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            tb.copy_(ta)
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1) * 1e3)
        tbw = 2 * n * 2 / (statistics.median(ts) * 1e-6) / 1e12
        RESULTS["peaks"]["torch_copy_TBps"] = tbw
        RESULTS["peaks"]["hbm_copy_TBps"] = max(bw, tbw)
        log(f"peaks: torch copy_ {tbw:.2f} TB/s; peak used = {max(bw, tbw):.2f} TB/s")
        del ta, tb
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001
        log(f"  torch copy skipped: {type(e).__name__}: {e}")


# ------------------------------------------------------------------ grouped matmul
def routing(rng, tokens):
    """Top-6 of 64 experts a token, distinct; rows sorted by expert -> group sizes."""
    choice = np.argsort(rng.random((tokens, EXPERTS)), axis=1)[:, :TOPK]
    return np.bincount(choice.ravel(), minlength=EXPERTS).astype(np.int32)


@guarded("grouped_matmul correctness extras")
def grouped_extra_checks():
    rng = np.random.default_rng(7)
    # Odd shapes: M, K, N not tile multiples, empty groups, 5 padding rows.
    m, k, n, g = 70, 96, 80, 5
    sizes = np.array([20, 0, 31, 14, 0], np.int32)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), jnp.bfloat16)
    got = jax.jit(functools.partial(gmm_mod.grouped_matmul_mgpu, **_interp()))(x, w, jnp.asarray(sizes))
    want = kernels_xla.grouped_matmul(x, w, jnp.asarray(sizes))
    tail = float(np.abs(np.asarray(got[65:], np.float32)).max())
    check("grouped odd shapes 70x96x80 G=5", got, want, extra={"tail_rows_absmax": tail})
    if tail != 0.0:
        RESULTS["errors"].append({"where": "grouped odd shapes", "error": f"tail rows not zero: {tail}"})
    # Decode with padding rows: 3 tokens' rows in an 8-token buffer (M = 48, 30 real rows).
    sizes = routing(rng, 5)
    x = jnp.asarray(rng.standard_normal((48, HIDDEN)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((EXPERTS, HIDDEN, INTER)) / np.sqrt(HIDDEN), jnp.bfloat16)
    if DRY:
        return
    got = jax.jit(gmm_mod.grouped_matmul_mgpu)(x, w, jnp.asarray(sizes))
    want = kernels_xla.grouped_matmul(x, w, jnp.asarray(sizes))
    tail = float(np.abs(np.asarray(got[30:], np.float32)).max())
    check("grouped decode with 18 padding rows", got, want, extra={"tail_rows_absmax": tail})
    if tail != 0.0:
        RESULTS["errors"].append({"where": "grouped decode padding", "error": f"tail rows not zero: {tail}"})


def shipped_ragged_dot(x, w, gs, block_m):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    return ragged_dot_mgpu.ragged_dot(x, w, group_sizes=gs, block_m=block_m, block_n=128,
                                      block_k=64, max_concurrent_steps=4, grid_block_n=1)


@guarded("grouped_matmul")
def grouped_case(tokens, which, variants, shipped, nsets):
    k, n = (HIDDEN, INTER) if which == "w1" else (INTER, HIDDEN)
    m = TOPK * tokens
    rng = np.random.default_rng(tokens * 10 + (which == "w2"))
    sets = []
    for i in range(nsets):
        sizes = routing(rng, tokens)
        x = jax.random.normal(jax.random.key(100 + i), (m, k), jnp.bfloat16)
        w = (jax.random.normal(jax.random.key(200 + i), (EXPERTS, k, n), jnp.float32)
             / np.sqrt(k)).astype(jnp.bfloat16)
        sets.append((x, w, jnp.asarray(sizes)))
    used = float(np.mean([int((np.asarray(s[2]) > 0).sum()) for s in sets]))
    flops = 2.0 * m * k * n
    bytes_ = m * k * 2 + used * k * n * 2 + m * n * 2
    x0, w0, g0 = sets[0]
    want = jax.jit(kernels_xla.grouped_matmul)(x0, w0, g0)
    label = f"grouped_matmul {which} tokens={tokens} M={m} K={k} N={n}"
    log(label)
    impls = [("xla", kernels_xla.grouped_matmul, {})]
    for name, cfg in variants:
        impls.append((name, functools.partial(gmm_mod.grouped_matmul_mgpu, **cfg, **_interp()), cfg))
    bm = 64 if m < 1024 else 128
    if shipped and m % bm == 0:
        impls.append((f"jax_ragged_dot_mgpu(bm={bm})",
                      lambda x, w, g, bm=bm: shipped_ragged_dot(x, w, g, bm), {}))
    for name, fn, cfg in impls:
        try:
            if name != "xla":
                got = jax.jit(fn)(x0, w0, g0)
                ok = check(f"{label} {name}", got, want)
                if not ok and not name.startswith("jax_"):
                    continue
            r = bench(fn, sets)
        except Exception as e:  # noqa: BLE001
            failed(f"{label} {name}", e)
            continue
        eff = None if name == "xla" or name.startswith("jax_") else \
            {**gmm_mod.default_blocks(m, k, n, EXPERTS), **cfg}
        rec = {"op": "grouped_matmul", "case": f"{which} tokens={tokens}", "impl": name,
               "tokens": tokens, "M": m, "K": k, "N": n, "experts_used": used, "config": eff,
               "flops": flops, "bytes": bytes_, **r,
               "TFLOPs": flops / (r["us"] * 1e-6) / 1e12, "TBps": bytes_ / (r["us"] * 1e-6) / 1e12}
        RESULTS["cases"].append(rec)
        log(f"  {name:34s} {r['us']:9.1f} us  (p10 {r['p10']:.1f} p90 {r['p90']:.1f})  "
            f"{rec['TFLOPs']:7.1f} TFLOP/s  {rec['TBps']:5.2f} TB/s")
        if name != "xla" or tokens == 1:
            log("      kernels: " + "; ".join(f"{k[:40]} {t:.1f}" for k, t in r.get("kernels", [])))


# ------------------------------------------------------------------ sparse attention
def sparse_inputs(seed, b, s, h, d, wk, n, k, masked=False):
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    k1, k2, k3 = jax.random.split(key, 3)
    q = jax.random.normal(k1, (b, s, h, d), jnp.bfloat16)
    win = jax.random.normal(k2, (b, wk, d), jnp.bfloat16)
    rows = jax.random.normal(k3, (b, n, d), jnp.bfloat16)
    idx = np.argsort(rng.random((b, s, n)), axis=-1)[..., :k].astype(np.int32)
    vis = np.ones((b, s, wk), bool)
    if masked:
        vis = rng.random((b, s, wk)) < 0.7
        idx[rng.random((b, s, k)) < 0.2] = -1
    wb = jnp.asarray(np.where(vis, 0.0, -np.inf), jnp.float32)
    sinks = jnp.asarray(rng.standard_normal(h), jnp.float32)
    return q, win, wb, rows, jnp.asarray(idx), sinks


@guarded("sparse_attention correctness extras")
def sparse_extra_checks():
    shapes = [(3, 2, 64, 512, 136, 700, 512), (2, 1, 32, 512, 128, 300, 200),
              (1, 1, 16, 256, 40, 50, 30)]
    for shape in shapes[-1:] if DRY else shapes:
        args = sparse_inputs(sum(shape), *shape, masked=True)
        want = jax.jit(kernels_xla.sparse_attention)(*args)
        for sp in (None, 1):
            got = jax.jit(functools.partial(sa_mod.sparse_attention_mgpu, splits=sp, **_interp()))(*args)
            check(f"sparse masked B,S,H,d,Wk,N,K={shape} splits={sp}", got, want)


@guarded("sparse_attention")
def sparse_case(b, variants, n_rows=4096, nsets=3):
    s, h, d, wk, k = 1, SPARSE["h"], SPARSE["d"], SPARSE["wk"], SPARSE["k"]
    n_rows = SPARSE.get("n", n_rows)
    sets = [sparse_inputs(1000 * b + i, b, s, h, d, wk, n_rows, k) for i in range(nsets)]
    flops = 4.0 * b * s * h * (wk + k) * d
    bytes_ = (b * s * h * d * 2 + b * wk * d * 2 + b * s * k * d * 2 + b * s * k * 4
              + b * s * wk * 4 + b * s * h * d * 2)
    want = jax.jit(kernels_xla.sparse_attention)(*sets[0])
    label = f"sparse_attention B={b} S={s} H={h} d={d} Wk={wk} K={k} N={n_rows}"
    log(label)
    impls = [("xla", kernels_xla.sparse_attention, {})]
    for name, cfg in variants:
        impls.append((name, functools.partial(sa_mod.sparse_attention_mgpu, **cfg, **_interp()), cfg))
    # The XLA half of the mosaic pipeline alone (gather + concat), to split its time.
    impls.append(("mgpu: XLA gather part only",
                  lambda q, win, wb, rows, idx, sk: sa_mod.gather_keys(win, wb, rows, idx, 64), None))
    for name, fn, cfg in impls:
        try:
            if cfg is not None and name != "xla":
                got = jax.jit(fn)(*sets[0])
                if not check(f"{label} {name}", got, want):
                    continue
            r = bench(fn, sets)
        except Exception as e:  # noqa: BLE001
            failed(f"{label} {name}", e)
            continue
        rec = {"op": "sparse_attention", "case": f"B={b}", "impl": name, "B": b, "S": s, "H": h,
               "d": d, "Wk": wk, "K": k, "N": n_rows, "config": cfg, "flops": flops,
               "bytes": bytes_, **r, "TFLOPs": flops / (r["us"] * 1e-6) / 1e12,
               "TBps": bytes_ / (r["us"] * 1e-6) / 1e12}
        RESULTS["cases"].append(rec)
        log(f"  {name:34s} {r['us']:9.1f} us  (p10 {r['p10']:.1f} p90 {r['p90']:.1f})  "
            f"{rec['TFLOPs']:7.2f} TFLOP/s  {rec['TBps']:5.2f} TB/s")
        log("      kernels: " + "; ".join(f"{k[:40]} {t:.1f}" for k, t in r.get("kernels", [])))


CHUNK = dict(h=32, d=512, window=128, topk=512, hca_ratio=128)
CHUNK_SHAPES = ((1, 4096), (8, 512))


def chunk_inputs(seed, b, s, layer, h, d, window, topk, hca_ratio):
    """A prefill chunk from position 0 (empty ring) of an SWA / HCA / CSA layer."""
    rng = np.random.default_rng(seed)
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(k1, (b, s, h, d), jnp.bfloat16)
    kv = jax.random.normal(k2, (b, s, d), jnp.bfloat16)
    args = (q, kv, jnp.zeros((b,), jnp.int32), jnp.full((b,), s, jnp.int32),
            jnp.zeros((b, window, d), jnp.bfloat16), jnp.full((b, window), -1, jnp.int32),
            jnp.asarray(rng.standard_normal(h), jnp.float32))
    visible_window = np.minimum(np.arange(s) + 1, window)            # keys a query sees
    kw = dict(window=window)
    extra = np.zeros(s)
    if layer != "swa":
        ratio = 4 if layer == "csa" else hca_ratio
        n = s // ratio
        vis = np.arange(n)[None, :] < ((np.arange(s) + 1) // ratio)[:, None]     # [S, N]
        if layer == "csa":          # top-k of the visible rows: a random subset of them
            score = np.where(vis, rng.random((s, n)), -1.0)
            keep = np.argsort(-score, axis=1)[:, :topk]
            sel = np.zeros_like(vis)
            np.put_along_axis(sel, keep, True, axis=1)
            vis &= sel
        extra = vis.sum(1)
        kw.update(extra_keys=jax.random.normal(k3, (b, n, d), jnp.bfloat16),
                  extra_bias=jnp.asarray(np.broadcast_to(np.where(vis, 0.0, -np.inf),
                                                         (b, s, n)), jnp.float32))
    flops = 4.0 * b * h * d * float((visible_window + extra).sum())
    return args, kw, flops


@guarded("chunk_attention")
def chunk_case(b, s, layer, variants, nsets=2):
    c = CHUNK
    sets, kws = [], []
    for i in range(nsets):
        a, kw, flops = chunk_inputs(7 * b + i, b, s, layer, c["h"], c["d"], c["window"], c["topk"],
                                    c["hca_ratio"])
        sets.append(a)
        kws.append(kw)
    label = f"chunk_attention {layer} {b}x{s} H={c['h']} d={c['d']}"
    log(label)
    window = c["window"]
    xla = functools.partial(kernels_xla.chunk_attention)
    impls = [("xla", xla, {})] + [(n, functools.partial(ca_mod.chunk_attention_mgpu, **cfg,
                                                         **_interp()), cfg)
                                  for n, cfg in variants]
    # Extra keys travel as arguments (not closure constants) so that every set is timed.
    pack = [a + ((kw["extra_keys"], kw["extra_bias"]) if "extra_keys" in kw else ())
            for a, kw in zip(sets, kws)]

    def call(fn):
        def f(*a):
            if len(a) == 9:
                return fn(*a[:7], window=window, extra_keys=a[7], extra_bias=a[8])
            return fn(*a, window=window)
        return f
    want = jax.jit(call(xla))(*pack[0])
    for name, fn, cfg in impls:
        try:
            if name != "xla":
                assert ca_mod.supported(sets[0][0], sets[0][1], sets[0][4], window,
                                        kws[0].get("extra_keys")), "kernel not supported here"
                if not check(f"{label} {name}", jax.jit(call(fn))(*pack[0]), want):
                    continue
            r = bench(call(fn), pack)
        except Exception as e:  # noqa: BLE001
            failed(f"{label} {name}", e)
            continue
        rec = {"op": "chunk_attention", "case": f"{layer} {b}x{s}", "impl": name, "B": b, "S": s,
               **{k: c[k] for k in ("h", "d", "window")}, "config": cfg, "flops": flops,
               "bytes": 0, **r, "TFLOPs": flops / (r["us"] * 1e-6) / 1e12, "TBps": 0.0}
        RESULTS["cases"].append(rec)
        log(f"  {name:34s} {r['us']:9.1f} us  (p10 {r['p10']:.1f} p90 {r['p90']:.1f})  "
            f"{rec['TFLOPs']:7.2f} TFLOP/s")
        log("      kernels: " + "; ".join(f"{k[:40]} {t:.1f}" for k, t in r.get("kernels", [])))


INDEX = dict(h=32, d=128, shapes=((1, 4096, 1024), (8, 512, 128)))


@guarded("index_scores")
def index_case(b, t, n, nsets=2):
    h, d = INDEX["h"], INDEX["d"]
    sets = []
    for i in range(nsets):
        k1, k2, k3 = jax.random.split(jax.random.key(100 + i), 3)
        sets.append((jax.random.normal(k1, (b, t, h, d), jnp.bfloat16),
                     jax.random.uniform(k2, (b, t, h), jnp.float32),
                     jax.random.normal(k3, (b, n, d), jnp.bfloat16)))
    label = f"index_scores {b}x{t} N={n} H={h} d={d}"
    log(label)
    flops = 2.0 * b * t * h * n * d
    bytes_ = b * t * h * d * 2 + b * t * h * 4 + b * n * d * 2 + b * t * n * 4
    want = jax.jit(kernels_xla.index_scores)(*sets[0])
    impls = [("xla", kernels_xla.index_scores),
             ("mosaic_gpu", functools.partial(idx_mod.index_scores_mgpu, **_interp()))]
    for name, fn in impls:
        try:
            if name != "xla":
                assert idx_mod.supported(*sets[0])
                if not check(f"{label} {name}", jax.jit(fn)(*sets[0]), want, tol=1e-4):
                    continue
            r = bench(fn, sets)
        except Exception as e:  # noqa: BLE001
            failed(f"{label} {name}", e)
            continue
        rec = {"op": "index_scores", "case": f"{b}x{t} N={n}", "impl": name, "B": b, "T": t,
               "N": n, "H": h, "d": d, "config": {}, "flops": flops, "bytes": bytes_, **r,
               "TFLOPs": flops / (r["us"] * 1e-6) / 1e12, "TBps": bytes_ / (r["us"] * 1e-6) / 1e12}
        RESULTS["cases"].append(rec)
        log(f"  {name:34s} {r['us']:9.1f} us  (p10 {r['p10']:.1f} p90 {r['p90']:.1f})  "
            f"{rec['TFLOPs']:7.2f} TFLOP/s  {rec['TBps']:5.2f} TB/s")


# ------------------------------------------------------------------ report
def table():
    pk = RESULTS.get("peaks", {})
    bw, tf = pk.get("hbm_copy_TBps"), pk.get("bf16_matmul_TFLOPs")
    lines = [f"device: {RESULTS['device']}   copy {bw and round(bw, 2)} TB/s   "
             f"bf16 matmul {tf and round(tf)} TFLOP/s   timing: "
             f"{sorted(set(c['timing'] for c in RESULTS['cases']))}",
             f"{'op':16s} {'case':18s} {'impl':34s} {'us':>9s} {'TFLOP/s':>8s} {'TB/s':>6s} "
             f"{'%peakBW':>7s} {'%peakMM':>7s} {'vs xla':>7s}"]
    xla = {(c["op"], c["case"]): c["us"] for c in RESULTS["cases"] if c["impl"] == "xla"}
    for c in RESULTS["cases"]:
        pb = 100 * c["TBps"] / bw if bw else float("nan")
        pm = 100 * c["TFLOPs"] / tf if tf else float("nan")
        c["pct_peak_bw"], c["pct_peak_matmul"] = pb, pm
        sp = xla.get((c["op"], c["case"]), float("nan")) / c["us"]
        c["speedup_vs_xla"] = sp
        lines.append(f"{c['op']:16s} {c['case']:18s} {c['impl'][:34]:34s} {c['us']:9.1f} "
                     f"{c['TFLOPs']:8.1f} {c['TBps']:6.2f} {pb:7.1f} {pm:7.1f} {sp:7.2f}")
    bad = [c for c in RESULTS["checks"] if not c["ok"]]
    lines.append(f"checks: {len(RESULTS['checks']) - len(bad)}/{len(RESULTS['checks'])} OK; "
                 f"errors: {len(RESULTS['errors'])}")
    for c in bad:
        lines.append(f"  FAILED CHECK {c['name']} rel_err={c['rel_err']:.2e} nans={c['nans']}")
    for e in RESULTS["errors"]:
        lines.append(f"  ERROR {e['where']}: {e['error'][:300]}")
    return "\n".join(lines)


def plot(path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ops = list(dict.fromkeys(c["op"] for c in RESULTS["cases"]))
    if not ops:
        return
    fig, axes = plt.subplots(1, len(ops), figsize=(7.5 * len(ops), 5), squeeze=False)
    for ax, op in zip(axes[0], ops):
        cs = [c for c in RESULTS["cases"] if c["op"] == op and not c["impl"].startswith("mgpu: ")]
        cases = list(dict.fromkeys(c["case"] for c in cs))
        impls = list(dict.fromkeys(c["impl"] for c in cs))
        wdt = 0.8 / max(len(impls), 1)
        for j, im in enumerate(impls):
            xs, ys = [], []
            for i, cs_ in enumerate(cases):
                v = [c["us"] for c in cs if c["case"] == cs_ and c["impl"] == im]
                if v:
                    xs.append(i + j * wdt)
                    ys.append(v[0])
            ax.bar(xs, ys, wdt, label=im)
        ax.set_xticks([i + 0.4 - wdt / 2 for i in range(len(cases))])
        ax.set_xticklabels(cases, rotation=30, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("GPU time (us, median)")
        ax.set_title(op)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--quick", action="store_true", help="fewer variants")
    ap.add_argument("--only", default="",
                    help="comma list: peaks,grouped,sparse,gchecks,schecks,chunk,index")
    ap.add_argument("--tag", default="", help="suffix of the result file names")
    ap.add_argument("--dry", action="store_true",
                    help="CPU plumbing test: tiny shapes, kernels in GPU interpret mode")
    ap.add_argument("--merge", nargs="*", default=None,
                    help="merge result JSON files (peaks from the first that has them), "
                         "write the table / JSON / PNG and exit")
    args = ap.parse_args()
    if args.merge:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for f in args.merge:
            part = json.loads(pathlib.Path(f).read_text())
            for k in ("cases", "errors", "checks"):
                RESULTS[k] += part.get(k, [])
            for k in ("peaks", "device", "jax", "host"):
                if k in part and k not in RESULTS:
                    RESULTS[k] = part[k]
            RESULTS.setdefault("commands", []).append(part.get("command"))
        txt = table()
        tag = "h200" if "H200" in RESULTS.get("device", "") else "gpu"
        RESULTS["table"] = txt.splitlines()
        (out / f"kernels_{tag}.json").write_text(json.dumps(RESULTS, indent=1, default=float))
        plot(out / f"kernels_{tag}.png")
        log(txt)
        return
    if args.dry:
        global HIDDEN, INTER, EXPERTS, GROUPED_TOKENS, SPARSE_BATCH, CHUNK_SHAPES
        HIDDEN, INTER, EXPERTS, GROUPED_TOKENS, SPARSE_BATCH = 128, 64, 8, (1, 16), (1,)
        SPARSE.update(h=8, d=128, wk=64, k=64, n=256)
        CHUNK.update(h=16, d=128, window=8, topk=4, hca_ratio=16)
        CHUNK_SHAPES = ((1, 40),)
        INDEX.update(h=16, d=64, shapes=((1, 64, 64),))
        DRY.update(iters=2)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = jax.devices()[0]
    RESULTS["device"] = f"{dev.device_kind} (cc {getattr(dev, 'compute_capability', '?')})"
    RESULTS["jax"] = jax.__version__
    RESULTS["host"] = platform.node()
    RESULTS["command"] = " ".join(sys.argv)
    log(f"device {RESULTS['device']}, jax {jax.__version__}, "
        f"mosaic available: {gmm_mod.grouped_matmul_mgpu.available()}")
    only = set(filter(None, args.only.split(","))) or {"peaks", "grouped", "sparse", "gchecks",
                                                       "schecks", "chunk", "index"}
    t0 = time.time()
    if "peaks" in only:
        peaks()
    if "gchecks" in only:
        grouped_extra_checks()
    if "schecks" in only:
        sparse_extra_checks()
    if "grouped" in only:
        for which in ("w1", "w2"):
            for tokens in GROUPED_TOKENS:
                if tokens < 4096:
                    variants = [("mosaic_gpu", {})]
                    if not args.quick:
                        variants.append(("mosaic_gpu bn=64 steps=6",
                                         dict(block_n=64, max_concurrent_steps=6)))
                else:
                    variants = [("mosaic_gpu", {})]
                    if not args.quick:
                        variants.append(("mosaic_gpu bm=64 bn=128 steps=6",
                                         dict(block_m=64, block_n=128, max_concurrent_steps=6)))
                grouped_case(tokens, which, variants,
                             shipped=tokens >= 16 and not args.quick and not args.dry,
                             nsets=1 if tokens == 4096 else 4)
    if "sparse" in only:
        for b in SPARSE_BATCH:
            variants = [("mosaic_gpu", {})]
            if not args.quick:
                variants.append(("mosaic_gpu qk_split=False", dict(qk_split=False)))
                if b > 1:
                    variants.append(("mosaic_gpu splits=1", dict(splits=1)))
                if b == 16:
                    variants.append(("mosaic_gpu splits=10", dict(splits=10)))
            sparse_case(b, variants)
    if "chunk" in only:
        for b, s in CHUNK_SHAPES:
            for layer in ("swa", "hca", "csa"):
                variants = [("mosaic_gpu", {})]
                if not args.quick:
                    variants.append(("mosaic_gpu stages=3", dict(stages=3)))
                chunk_case(b, s, layer, variants)
    if "index" in only:
        for b, t, n in INDEX["shapes"]:
            index_case(b, t, n)
    RESULTS["wall_s"] = time.time() - t0
    txt = table()
    tag = ("h200" if "H200" in RESULTS["device"] else "gpu") + (f"_{args.tag}" if args.tag else "")
    RESULTS["table"] = txt.splitlines()
    (out / f"kernels_{tag}.json").write_text(json.dumps(RESULTS, indent=1, default=float))
    if not args.tag:
        plot(out / f"kernels_{tag}.png")
    log("\n" + txt)


if __name__ == "__main__":
    main()
