"""Multi-GPU checks and scaling on whatever devices this host has, in one run.

Sections (each in its own share of --budget; the results JSON is rewritten after every point):

1. equal: sharded `forward`, greedy `generate` and the Engine on dp x ep meshes over all
   devices == the single-device outputs (max |logit diff|, token equality; bf16 greedy tokens
   may part at a near tie, accepted only when the two runs' logprobs there differ < --tie-tol).
2. moe_layer: one v4-flash-shaped routed-expert layer at EP = device count, fixed vs ragged
   dispatch, per tokens-per-device: step time, bytes moved (`shardings.moe.dispatch_bytes`)
   and a roofline from bandwidths and a bf16 peak measured in this run.
3. decode_scaling: generate's device loop (`decode_block`) on meshes over 1, 2, ... devices,
   ragged vs fixed, per sequences-per-device: step time, tokens/s, dispatch bytes per step.
4. balancer: redundant experts (`shardings.balancer`) on a routing trace captured from the
   default model's real router on text, and on a Zipf trace: max/mean device rows of the
   dispatch, static vs balanced (planned on one half, scored on the other).
5. multihost: one process per device through `jax.distributed`, the sharded forward vs the
   single-device forward.

Numbers from --quick on CPU (8 fake XLA:CPU devices, `tiny` preset, scaled-down layer) only
check that the code runs; the ragged dispatch is then `ragged_emulated` (labelled so).

GPU session (2/4/8 H200s; NVLink multicast stays off: NCCL_NVLS_ENABLE=0 and the other two
switches are kept set, here and in the workers). A command may run 10 minutes, so three
commands (N = the GPU count; python3 is the device image's JAX), about 20 minutes in all:

    python3 benchmarks/multi_gpu.py --sections equal,multihost --budget 480 \
        --out benchmarks/results/multi_gpu_h200xN_a.json
    python3 benchmarks/multi_gpu.py --sections moe_layer,balancer --budget 400 \
        --out benchmarks/results/multi_gpu_h200xN_b.json
    python3 benchmarks/multi_gpu.py --sections decode_scaling --budget 480 \
        --out benchmarks/results/multi_gpu_h200xN_c.json
    python benchmarks/plot_multi_gpu.py benchmarks/results/multi_gpu_h200xN_{a,b,c}.json

Expected wall time on 8 H200s (estimates, not measured: mini decode programs compiled in
45-160 s on one H200, benchmarks/results/decode_mini_h200.json): startup ~1 min a command;
equal ~5 min (forward, generate and engine programs for one device and two meshes),
multihost ~2 min; moe_layer ~3 min, balancer < 1 min; decode_scaling ~1-1.5 min per
(devices, dispatch, sequences) point, 14 points on 8 GPUs, measured in the order 1, N, then
the rest, so 480 s gets the ends of the table (add `--gpu-counts 2,4` in a fourth command if
device time is left). Each point is saved as it finishes: a command killed at its limit
keeps what it measured. A section stops starting points when less time is left than the
last point took.

    python benchmarks/multi_gpu.py --quick    # this CPU machine: ~4 min with a warm compile
                                              # cache (.jax_cache), ~9 min cold on 2 cores
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = ("equal", "moe_layer", "decode_scaling", "balancer", "multihost")
# share of --budget per section
BUDGET_SHARE = {"equal": 0.25, "moe_layer": 0.15, "decode_scaling": 0.35, "balancer": 0.05,
                "multihost": 0.2}
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}


def has_accelerator() -> bool:
    """An NVIDIA GPU is visible (checked before jax starts, so CPU fakes can be set up)."""
    return os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") is not None


def set_up_environment(quick: bool, fake_devices: int = 8) -> None:
    """Before importing jax: multicast off; with --quick and no GPU, `fake_devices` CPU devices."""
    for k, v in MULTICAST_OFF.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if quick and not has_accelerator():
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = (flags + f" --xla_force_host_platform_device_count="
                                       f"{fake_devices}").strip()
    elif has_accelerator():
        # leave memory for the one-process-per-GPU workers of the multihost section
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.7")


# ------------------------------------------------------------------------- pure helpers
def equal_meshes(n_devices: int) -> list[tuple[int, int]]:
    """(dp, ep) meshes over all n devices the equality section checks: (1, n), and
    (n/2, 2) when n >= 4 (both axes); (1, 1) alone for one device."""
    if n_devices < 1:
        raise ValueError(f"n_devices must be >= 1, got {n_devices}")
    out = [(1, n_devices)]
    if n_devices >= 4 and n_devices % 2 == 0:
        out.append((n_devices // 2, 2))
    return out


def scaling_counts(n_devices: int, n_experts: int) -> list[int]:
    """Device counts 1..n whose EP group divides the experts (a mesh dp=1, ep=g each)."""
    if n_devices < 1 or n_experts < 1:
        raise ValueError(f"need n_devices, n_experts >= 1, got {n_devices}, {n_experts}")
    return [g for g in range(1, n_devices + 1) if n_experts % g == 0]


def scaling_order(counts) -> list[int]:
    """The order decode_scaling measures device counts in: 1 and the largest first (the ends
    of the table survive a short budget), then the rest ascending."""
    counts = sorted(set(counts))
    ends = [g for g in (counts[0], counts[-1])] if counts else []
    return list(dict.fromkeys(ends + counts))


def expert_work(idx, n_experts: int, ep: int, hidden: int, inter: int,
                itemsize: int = 2) -> dict:
    """Per-device work of one EP MoE layer (dp=1): idx [N,k] global expert ids, the N tokens
    split evenly over ep devices, experts [d*E/ep, (d+1)*E/ep) on device d. Returns arrays [ep]:
    rows received, distinct local experts with >= 1 row, their weight bytes (w1, w3, w2 of
    [D,I], [D,I], [I,D]) and the expert FLOPs (2 * rows * 3 * D * I)."""
    import numpy as np
    idx = np.asarray(idx)
    if n_experts % ep or idx.shape[0] % ep:
        raise ValueError(f"{idx.shape[0]} tokens / {n_experts} experts do not split over ep={ep}")
    owner = idx.reshape(-1) // (n_experts // ep)
    rows = np.bincount(owner, minlength=ep)
    touched = np.zeros(ep, np.int64)
    for e in np.unique(idx):
        touched[e // (n_experts // ep)] += 1
    per_expert = 3 * hidden * inter * itemsize
    return {"rows": rows, "experts_touched": touched, "weight_bytes": touched * per_expert,
            "flops": 2 * rows * 3 * hidden * inter}


def roofline(weight_bytes: float, hbm_Bps: float, comm_bytes: float, link_Bps: float,
             flops: float, peak_flops: float) -> dict:
    """Lower bound of a layer's time: memory side = weights / HBM + dispatch / link (serial:
    the exchange precedes and follows the GEMMs), compute side = FLOPs / peak; the bound is
    the larger side."""
    for name, v in (("hbm_Bps", hbm_Bps), ("link_Bps", link_Bps), ("peak_flops", peak_flops)):
        if not v > 0:
            raise ValueError(f"{name} must be > 0, got {v}")
    hbm_s = weight_bytes / hbm_Bps
    comm_s = comm_bytes / link_Bps
    compute_s = flops / peak_flops
    return {"hbm_s": hbm_s, "comm_s": comm_s, "compute_s": compute_s,
            "roofline_s": max(hbm_s + comm_s, compute_s)}


def alltoall_remote_bytes(bytes_per_device: int, n_devices: int) -> int:
    """Bytes leaving each device in a tiled all_to_all of a `bytes_per_device` buffer."""
    return bytes_per_device * (n_devices - 1) // n_devices


def first_divergence(a, b) -> list[int]:
    """Per row, the first column where token arrays a, b [B, T] differ (-1: identical)."""
    import numpy as np
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        raise ValueError(f"token arrays differ in shape: {a.shape} vs {b.shape}")
    diff = a != b
    return [int(np.argmax(r)) if r.any() else -1 for r in diff]


def section_budgets(total_s: float, sections) -> dict[str, float]:
    """Seconds per section: `total_s` split by BUDGET_SHARE over the chosen sections."""
    share = sum(BUDGET_SHARE[s] for s in sections)
    return {s: total_s * BUDGET_SHARE[s] / share for s in sections}


# ------------------------------------------------------------------------- run context
class Budget:
    """A section's deadline. `over()`: too little time is left for another point as long as
    the last one took (points start only when they should finish in time); `done_point()`
    records a point's end and saves the results so far (a killed run keeps them)."""

    def __init__(self, seconds: float, save=lambda: None):
        self.t0, self.seconds, self.save = time.perf_counter(), seconds, save
        self.last_start, self.last_cost = self.t0, 0.0

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.t0)

    def over(self) -> bool:
        return self.left() <= self.last_cost

    def done_point(self) -> None:
        now = time.perf_counter()
        self.last_cost, self.last_start = now - self.last_start, now
        self.save()


def timed(fn, reps: int):
    """Median seconds of `reps` calls of fn() (results blocked on), after one warm call;
    returns (median seconds, first-call seconds)."""
    import jax
    import numpy as np
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), first


def platform_ragged(platform: str) -> str:
    from shardings import moe
    return "ragged" if platform.lower() in moe.RAGGED_PLATFORMS else "ragged_emulated"


def make_params(cfg, dtype, seed=0):
    from benchmarks.decode import device_params
    return device_params(cfg, dtype, seed)


# ------------------------------------------------------------------------- measurements
def hbm_bandwidth(nbytes: int, reps: int = 10) -> float:
    """Bytes/s of a read + write of an `nbytes` f32 array on device 0."""
    import jax
    import jax.numpy as jnp
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001)
    s, _ = timed(lambda: f(x), reps)
    return 2 * x.size * 4 / s


def bf16_peak(n: int, reps: int = 10) -> float:
    """FLOP/s of an n x n x n bf16 matmul on device 0."""
    import jax
    import jax.numpy as jnp
    a = jnp.ones((n, n), jnp.bfloat16)
    f = jax.jit(lambda x: x @ x)
    s, _ = timed(lambda: f(a), reps)
    return 2 * n ** 3 / s


def alltoall_bandwidth(devices, nbytes: int, reps: int = 10) -> dict:
    """Per-device bytes/s leaving each device in a tiled bf16 all_to_all of `nbytes` per
    device over `devices` (and the psum bus bandwidth 2(n-1)/n * bytes / s)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    n = len(devices)
    mesh = Mesh(np.asarray(devices), ("x",))
    rows = max(nbytes // (2 * 1024) // n * n, n)
    x = jax.device_put(jnp.ones((n * rows, 1024), jnp.bfloat16), NamedSharding(mesh, P("x")))
    a2a = jax.jit(jax.shard_map(lambda b: jax.lax.all_to_all(b, "x", 0, 0, tiled=True),
                                mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    psum = jax.jit(jax.shard_map(lambda b: jax.lax.psum(b, "x"), mesh=mesh, in_specs=P("x"),
                                 out_specs=P("x")))
    per_dev = rows * 1024 * 2
    s_a2a, _ = timed(lambda: a2a(x), reps)
    s_psum, _ = timed(lambda: psum(x), reps)
    return {"bytes_per_device": per_dev,
            "all_to_all_Bps": alltoall_remote_bytes(per_dev, n) / s_a2a,
            "psum_bus_Bps": 2 * (n - 1) / n * per_dev / s_psum,
            "all_to_all_s": s_a2a, "psum_s": s_psum}


# ------------------------------------------------------------------------- 1. equal
def section_equal(args, budget, res):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import deepinfer_fn as di
    import shardings
    from deepinfer_fn.engine import Engine, Request

    cfg = di.ModelConfig.preset(args.preset)
    dtype = jnp.float32 if args.quick or args.equal_f32 else jnp.bfloat16
    params = make_params(cfg, dtype)
    n = jax.device_count()
    rng = np.random.default_rng(0)
    B, T = 2 * n, 32 if args.quick else 96
    tokens = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    lengths = rng.integers(T // 2, T + 1, B).astype(np.int32)
    n_new = 6 if args.quick else 16
    eng_kw = dict(max_batch=2 * n, page_size=16, max_len=128 if args.quick else 256,
                  max_tokens_per_step=256, progress=False)
    prompts = [rng.integers(2, cfg.vocab_size, int(m)).tolist() for m in lengths[: 2 * n]]
    reqs = lambda: [Request(list(p), max_new_tokens=n_new, request_id=i)
                    for i, p in enumerate(prompts)]

    ref_logits = np.asarray(di.forward(params, tokens), np.float32)
    ref_gen = di.generate(params, tokens, lengths=lengths, max_new_tokens=n_new,
                          return_logprobs=True)
    ref_eng = [o.tokens for o in Engine(params, **eng_kw).generate(reqs())]
    scale = float(np.abs(ref_logits).max())
    out = {"preset": args.preset, "dtype": str(np.dtype(dtype)), "rows": B, "prompt_len": T,
           "new_tokens": n_new, "meshes": [], "ok": True,
           "rule": "f32: logits within --logit-tol, generate and engine tokens identical; "
                   "bf16: logits within --logit-tol, a generate divergence only at a near tie "
                   "(logprob gap < --tie-tol); engine differences reported, not failed"}
    res["equal"] = out
    for dp, ep in equal_meshes(n):
        if budget.over():
            out["meshes"].append({"dp": dp, "ep": ep, "skipped": "budget"})
            continue
        mesh = shardings.make_mesh(dp=dp, ep=ep)
        sp = shardings.shard_params(params, mesh)
        t0 = time.perf_counter()
        logits = np.asarray(di.forward(sp, tokens), np.float32)
        diff = float(np.abs(logits - ref_logits).max())
        gen = di.generate(sp, tokens, lengths=lengths, max_new_tokens=n_new, return_logprobs=True)
        a, b = np.asarray(gen.tokens), np.asarray(ref_gen.tokens)
        div = first_divergence(a, b)
        tie_gap = [float(abs(np.asarray(gen.logprobs)[r, c] - np.asarray(ref_gen.logprobs)[r, c]))
                   for r, c in enumerate(div) if c >= 0]
        run_engine = not (args.quick and out["meshes"])    # --quick: the first mesh only
        eng = ([o.tokens for o in Engine(sp, **eng_kw).generate(reqs())] if run_engine
               else ref_eng)
        eng_div = sum(x != y for x, y in zip(eng, ref_eng))
        rel = diff / max(scale, 1e-30)
        exact = dtype == jnp.float32
        gen_ok = all(c < 0 for c in div) or (not exact and max(tie_gap) < args.tie_tol)
        ok = rel <= args.logit_tol and gen_ok and (eng_div == 0 or not exact)
        row = {"dp": dp, "ep": ep, "max_abs_logit_diff": diff, "rel_logit_diff": rel,
               "generate_tokens_equal": bool((a == b).all()), "generate_first_divergence": div,
               "generate_logprob_gap_at_divergence": tie_gap,
               "engine_requests_differing": int(eng_div) if run_engine else None,
               "ok": bool(ok),
               "seconds": time.perf_counter() - t0}
        out["ok"] &= bool(ok)
        out["meshes"].append(row)
        budget.done_point()
        print(f"equal dp={dp} ep={ep}: max|dlogit| {diff:.3e} (rel {rel:.2e}), generate equal "
              f"{row['generate_tokens_equal']}, engine differing {eng_div}, ok={ok}", flush=True)
        jax.clear_caches()


# ------------------------------------------------------------------------- 2. moe_layer
def moe_shapes(quick: bool) -> dict:
    """The layer's sizes: the v4-flash preset's (scaled down with --quick)."""
    from deepinfer_fn.config import ModelConfig
    cfg = ModelConfig.preset("v4-flash")
    full = {"experts": cfg.n_routed_experts, "k": cfg.num_experts_per_tok,
            "hidden": cfg.hidden_size, "inter": cfg.moe_intermediate_size,
            "limit": cfg.swiglu_limit}
    if quick:
        return {**full, "experts": 32, "hidden": 256, "inter": 128}
    return full


def section_moe_layer(args, budget, res):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import shardings
    from deepinfer_fn.model.experts import routed_experts
    from shardings import moe
    from shardings.balancer import synthetic_routing

    sh = moe_shapes(args.quick)
    E, k, D, I, limit = sh["experts"], sh["k"], sh["hidden"], sh["inter"], sh["limit"]
    devices = jax.devices()
    ep = len(devices)
    platform = devices[0].platform
    mesh = shardings.make_mesh(ep=ep)
    hbm = hbm_bandwidth(2 ** 26 if args.quick else 4 * 2 ** 30)
    peak = bf16_peak(512 if args.quick else 8192)
    link = alltoall_bandwidth(devices, 2 ** 22 if args.quick else 2 ** 30)
    link_Bps = link["all_to_all_Bps"]
    out = {"shapes": sh, "ep": ep, "platform": platform, "hbm_Bps": hbm, "bf16_peak_flops": peak,
           "interconnect": link, "fp8_note": "expert weights run in bf16 (the model dequantizes "
           "FP8 checkpoints at load); fp8_roofline_s halves the weight bytes on paper only",
           "bytes_note": "bytes are the dispatch contract's (shardings.moe.dispatch_bytes); "
           "ragged_emulated (CPU) really moves more: padded dense blocks", "points": []}
    res["moe_layer"] = out
    print(f"moe_layer: E={E} k={k} D={D} I={I} ep={ep} on {platform}; HBM {hbm / 1e9:.1f} GB/s, "
          f"bf16 {peak / 1e12:.1f} TFLOP/s, all_to_all {link_Bps / 1e9:.1f} GB/s per device",
          flush=True)
    rng = np.random.default_rng(0)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)
    keys = jax.random.split(jax.random.key(0), 3)      # on the device: GiBs of weights
    p = {name: (0.02 * jax.random.normal(kk, shape, jnp.float32)).astype(jnp.bfloat16)
         for kk, (name, shape) in zip(keys, [("w1", (E, D, I)), ("w3", (E, D, I)),
                                             ("w2", (E, I, D))])}
    p_ep = {key: jax.device_put(v, NamedSharding(mesh, P("ep"))) for key, v in p.items()}
    ragged = platform_ragged(platform)
    single = jax.jit(lambda *a: routed_experts(*a, limit))
    tokens = args.moe_tokens or ((16, 64) if args.quick else (64, 256, 1024))
    for n in tokens:
        for routing in ("uniform", "zipf"):
            if budget.over():
                out["points"].append({"tokens_per_device": n, "routing": routing,
                                      "skipped": "budget"})
                continue
            idx_np = synthetic_routing(routing, n * ep, E, k, seed=1)
            x = bf(rng.standard_normal((n * ep, D), np.float32))
            w = jnp.asarray(rng.random((n * ep, k), np.float32))
            idx = jnp.asarray(idx_np)
            want = np.asarray(single(p, x, idx, w), np.float32)
            rows = jax.device_put((x, idx, w), NamedSharding(mesh, P(("dp", "ep"))))
            work = expert_work(idx_np, E, ep, D, I)
            by = moe.dispatch_bytes(idx_np, E, 1, ep, hidden=D)
            for dispatch in ("fixed", ragged):
                fn = jax.jit(lambda p_, x_, i_, w_, d=dispatch: moe.ep_routed_experts(
                    p_, x_, i_, w_, limit, mesh, dispatch=d))
                s, first = timed(lambda: fn(p_ep, *rows), args.reps)
                got = np.asarray(fn(p_ep, *rows), np.float32)
                key = "fixed" if dispatch == "fixed" else "ragged"
                comm = int(by[f"{key}_remote"].max())
                wb = int(work["weight_bytes"].max())
                roof = roofline(wb, hbm, comm, link_Bps, float(work["flops"].max()), peak)
                roof8 = roofline(wb / 2, hbm, comm, link_Bps, float(work["flops"].max()), peak)
                pt = {"tokens_per_device": n, "routing": routing, "dispatch": dispatch,
                      "step_s": s, "compile_s": first,
                      "rel_err_vs_single_device": float(np.abs(got - want).max()
                                                        / max(np.abs(want).max(), 1e-30)),
                      "bytes_sent_per_device": int(by[key].max()),
                      "bytes_remote_per_device": comm,
                      "weight_bytes_per_device_max": wb,
                      "experts_touched_max": int(work["experts_touched"].max()),
                      "rows_received_max": int(work["rows"].max()),
                      "flops_per_device_max": int(work["flops"].max()),
                      **roof, "fp8_roofline_s": roof8["roofline_s"],
                      "achieved_over_roofline": roof["roofline_s"] / s}
                out["points"].append(pt)
                out["ok"] = out.get("ok", True) and pt["rel_err_vs_single_device"] <= args.moe_tol
                budget.done_point()
                print(f"  n={n:5d} {routing:7s} {dispatch:16s} {s * 1e3:9.3f} ms  roofline "
                      f"{roof['roofline_s'] * 1e3:8.3f} ms  sent {pt['bytes_sent_per_device'] / 1e6:8.2f}"
                      f" MB  err {pt['rel_err_vs_single_device']:.1e}", flush=True)
    jax.clear_caches()


# ------------------------------------------------------------------------- 3. decode_scaling
def section_decode_scaling(args, budget, res):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import deepinfer_fn as di
    import shardings
    from benchmarks.decode import filled_state
    from deepinfer_fn.decoding.plain import decode_block, stop_array
    from deepinfer_fn.decoding.rows import on_mesh
    from deepinfer_fn.sampling import sampling_params
    from shardings import moe
    from shardings.balancer import synthetic_routing

    cfg = di.ModelConfig.preset(args.preset)
    dtype = jnp.float32 if args.quick else jnp.bfloat16
    params = make_params(cfg, dtype)
    devices = jax.devices()
    platform = devices[0].platform
    ragged = platform_ragged(platform)
    counts = args.gpu_counts or scaling_counts(len(devices), cfg.n_routed_experts)
    if args.quick:
        counts = [g for g in counts if g in (1, 2, len(devices))]
    counts = scaling_order(counts)
    per_dev = args.seqs_per_device or ((4,) if args.quick else (64, 256))
    steps, ctx = (4, 64) if args.quick else (16, args.context)
    out = {"preset": args.preset, "dtype": str(np.dtype(dtype)), "context": ctx, "steps": steps,
           "platform": platform, "bytes_note": "dispatch bytes per step estimated from a uniform "
           "routing of the step's tokens (shardings.moe.dispatch_bytes), summed over MoE layers",
           "points": []}
    res["decode_scaling"] = out
    for g in counts:
        mesh = shardings.make_mesh(ep=g, devices=devices[:g]) if g > 1 else None
        sp = shardings.shard_params(params, mesh) if mesh is not None else params
        for dispatch in (("fixed", ragged) if g > 1 else ("n/a",)):
            for s_per in per_dev:
                if budget.over():
                    out["points"].append({"devices": g, "dispatch": dispatch,
                                          "seqs_per_device": s_per, "skipped": "budget"})
                    continue
                B = s_per * g
                state = on_mesh(filled_state(cfg, B, ctx, dtype), mesh)
                logits = jnp.zeros((B, cfg.vocab_size), jnp.float32)
                done = jnp.zeros((B,), bool)
                sampling = sampling_params(B)
                if mesh is not None:
                    logits, done, sampling = on_mesh((logits, done, sampling), mesh)
                stops = stop_array(())
                carry = {"state": state, "logits": logits}

                def run(sp=sp, carry=carry, done=done, sampling=sampling):
                    o = decode_block(sp, carry["state"], carry["logits"], done, sampling,
                                     jnp.int32(0), n=steps, stops=stops, feed_last=True)
                    carry["state"], carry["logits"] = o[3], o[4]
                    return o[0]

                jax.clear_caches()          # the dispatch is read at trace time
                ctx_mesh = jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()
                with ctx_mesh, moe.use_dispatch("fixed" if dispatch == "n/a" else dispatch):
                    s, first = timed(run, args.reps)
                step_s = s / steps
                idx = synthetic_routing("uniform", B, cfg.n_routed_experts,
                                        cfg.num_experts_per_tok, seed=2)
                key = "ragged" if dispatch.startswith("ragged") else "fixed"
                layers = cfg.num_hidden_layers
                moved = (int(moe.dispatch_bytes(idx, cfg.n_routed_experts, 1, g,
                                                hidden=cfg.hidden_size)[f"{key}_remote"].max())
                         * layers if g > 1 else 0)
                pt = {"devices": g, "dispatch": dispatch, "seqs_per_device": s_per,
                      "batch": B, "step_s": step_s, "tokens_per_s": B / step_s,
                      "tokens_per_s_per_device": s_per / step_s, "compile_s": first,
                      "remote_bytes_per_device_per_step": moved}
                out["points"].append(pt)
                budget.done_point()
                print(f"decode g={g} {dispatch:16s} seqs/dev={s_per:4d}: step "
                      f"{step_s * 1e3:8.3f} ms  {B / step_s:10.1f} tok/s  remote "
                      f"{moved / 1e6:7.2f} MB/step", flush=True)
        jax.clear_caches()


# ------------------------------------------------------------------------- 4. balancer
def router_trace(n_tokens: int):
    """Routing of the default model's real router over text (the tokenized source of this
    file and shardings/*.py): per MoE layer [T, k] logical expert ids, captured eagerly."""
    import jax
    import numpy as np
    import deepinfer_fn as di
    from deepinfer_fn.model import moe as model_moe

    model = di.load_model(drafter=False)
    params, tok = model.params, model.tokenizer
    text = ""
    for name in ("benchmarks/multi_gpu.py", "shardings/moe.py", "shardings/balancer.py",
                 "shardings/mesh.py", "shardings/experiment.py"):
        with open(os.path.join(ROOT, name)) as f:
            text += f.read()
    ids = np.asarray(tok.encode(text)[: n_tokens], np.int32)
    captured = []
    real_route = model_moe.route

    def capture(p, x, token_ids, mlp_type, cfg):
        idx, w = real_route(p, x, token_ids, mlp_type, cfg)
        captured.append(np.asarray(idx))
        return idx, w

    model_moe.route = capture
    try:
        with jax.disable_jit():
            seg = 256
            per_call = []
            for s in range(0, len(ids) - seg + 1, seg):
                captured.clear()
                di.forward(params, ids[None, s:s + seg])
                per_call.append(list(captured))
    finally:
        model_moe.route = real_route
    layers = len(per_call[0])
    return ([np.concatenate([c[l] for c in per_call]) for l in range(layers)],
            params.config.n_routed_experts)


def balance_rows(idx_plan, idx_eval, n_experts: int, n_devices: int, n_redundant: int) -> dict:
    """Rows each device receives in the dispatch (dp=1): static contiguous placement vs the
    planner's (planned on idx_plan, scored on idx_eval [T, k] after `route_to_replicas`)."""
    import numpy as np
    from shardings import moe
    from shardings.balancer import expert_load, plan_replicas, route_to_replicas
    T = idx_eval.shape[0] // n_devices * n_devices
    ev = idx_eval[:T]
    static = moe.dispatch_rows(ev, n_experts, 1, n_devices)["ragged_received"]
    pl = plan_replicas(expert_load(idx_plan, n_experts), n_devices, n_redundant)
    phys = np.asarray(route_to_replicas(ev, np.arange(T, dtype=np.int32), pl.logical_to_phys,
                                        pl.replica_count))
    bal = moe.dispatch_rows(phys, pl.n_physical, 1, n_devices)["ragged_received"]
    mm = lambda r: float(r.max() / r.mean())
    return {"devices": n_devices, "redundant": n_redundant, "tokens": int(T),
            "static_rows": static.tolist(), "balanced_rows": bal.tolist(),
            "static_max_over_mean": mm(static), "balanced_max_over_mean": mm(bal)}


def section_balancer(args, budget, res):
    import jax
    from shardings.balancer import synthetic_routing

    n = jax.device_count()
    out = {"traces": []}
    res["balancer"] = out
    layers, E = router_trace(1024 if args.quick else 4096)
    for d in (g for g in (2, 4, 8) if g <= max(n, 2) and E % g == 0):
        for layer, idx in enumerate(layers):
            half = idx.shape[0] // 2
            for r in (d, 2 * d):
                row = {"trace": f"default model router, layer {layer}", "experts": E,
                       **balance_rows(idx[:half], idx[half:], E, d, r)}
                out["traces"].append(row)
                print(f"balancer {row['trace']:32s} D={d} R={r}: static "
                      f"{row['static_max_over_mean']:.3f} balanced "
                      f"{row['balanced_max_over_mean']:.3f}", flush=True)
    E2, k2 = 256, 6
    T = 4096 if args.quick else 16384
    for d in sorted({max(n, 2), 8}):
        plan = synthetic_routing("zipf", T, E2, k2, seed=3, sample=0)
        held = synthetic_routing("zipf", T, E2, k2, seed=3, sample=1)
        row = {"trace": "zipf s=1.0", "experts": E2, **balance_rows(plan, held, E2, d, d)}
        out["traces"].append(row)
        print(f"balancer zipf E=256 D={d} R={d}: static {row['static_max_over_mean']:.3f} "
              f"balanced {row['balanced_max_over_mean']:.3f}", flush=True)


# ------------------------------------------------------------------------- 5. multihost
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def section_multihost(args, budget, res):
    import tempfile

    import jax

    n_proc = min(2, jax.device_count()) if args.quick else jax.device_count()
    gpu = jax.devices()[0].platform == "gpu"
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="multi_gpu_multihost_")
    base = {k: v for k, v in os.environ.items()
            if k not in ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION")}
    base.update(MULTICAST_OFF)
    base["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    procs = []
    for pid in range(n_proc):
        env = dict(base, DEEPINFER_COORDINATOR=f"127.0.0.1:{port}",
                   DEEPINFER_NUM_PROCESSES=str(n_proc), DEEPINFER_PROCESS_ID=str(pid),
                   DEEPINFER_OUT=tmp, DEEPINFER_PRESET=args.preset,
                   DEEPINFER_GPU="1" if gpu else "0", PYTHONPATH=ROOT)
        if not gpu:
            env["JAX_PLATFORMS"] = "cpu"
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__),
                                       "--multihost-worker"], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = []
    t0 = time.perf_counter()
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(budget.left(), 60))[0])
        except subprocess.TimeoutExpired:
            p.kill()
            logs.append(p.communicate()[0])
    ok_rc = all(p.returncode == 0 for p in procs)
    out = {"processes": n_proc, "platform": "gpu" if gpu else "cpu", "returncodes":
           [p.returncode for p in procs], "seconds": time.perf_counter() - t0}
    if ok_rc:
        with open(os.path.join(tmp, "result.json")) as f:
            out.update(json.load(f))
    else:
        out["log_tail"] = [l[-2000:] for l in logs]
    out["ok"] = bool(ok_rc and out.get("rel_logit_diff", 1.0) <= args.logit_tol)
    res["multihost"] = out
    print(f"multihost {n_proc} processes: rc {out['returncodes']}, rel logit diff "
          f"{out.get('rel_logit_diff')}, ok={out['ok']}", flush=True)


def multihost_worker() -> None:
    """One process of the multihost section (one local device each): the sharded forward over
    all processes (dp=1, ep=processes); process 0 also runs the single-device forward."""
    n_proc, pid = int(os.environ["DEEPINFER_NUM_PROCESSES"]), int(os.environ["DEEPINFER_PROCESS_ID"])
    gpu = os.environ["DEEPINFER_GPU"] == "1"
    if not gpu:
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    import jax
    if not gpu:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=os.environ["DEEPINFER_COORDINATOR"],
                               num_processes=n_proc, process_id=pid,
                               local_device_ids=[pid] if gpu else None)
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    import deepinfer_fn as di
    import shardings
    assert jax.device_count() == n_proc and jax.local_device_count() == 1, jax.devices()
    cfg = di.ModelConfig.preset(os.environ["DEEPINFER_PRESET"])
    dtype = jnp.bfloat16 if gpu else jnp.float32
    local = make_params(cfg, dtype)                           # same seed -> same values
    host = di.Params(jax.device_get(local.weights), cfg)
    mesh = shardings.make_mesh(ep=n_proc)
    sharded = shardings.shard_params(host, mesh)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2 * n_proc, 32)).astype(np.int32)
    logits = di.forward(sharded, tokens)
    full = np.asarray(multihost_utils.process_allgather(logits, tiled=True), np.float32)
    if pid == 0:
        want = np.asarray(di.forward(local, tokens), np.float32)
        diff = float(np.abs(full - want).max())
        with open(os.path.join(os.environ["DEEPINFER_OUT"], "result.json"), "w") as f:
            json.dump({"max_abs_logit_diff": diff,
                       "rel_logit_diff": diff / max(float(np.abs(want).max()), 1e-30),
                       "mesh": {"dp": 1, "ep": n_proc}, "devices": [str(d) for d in jax.devices()]}, f)
    print(f"process {pid} done", flush=True)


# ------------------------------------------------------------------------- main
RUNNERS = {"equal": section_equal, "moe_layer": section_moe_layer,
           "decode_scaling": section_decode_scaling, "balancer": section_balancer,
           "multihost": section_multihost}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes; 8 fake CPU devices "
                    "when no GPU is present")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--budget", type=float, default=1500.0, help="seconds for all sections")
    ap.add_argument("--out", default=None, help="results JSON (default "
                    "benchmarks/results/multi_gpu_<platform>x<N>.json)")
    ap.add_argument("--preset", default=None, help="model for equal / decode / multihost "
                    "(default mini; tiny with --quick)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--context", type=int, default=1024, help="decode context (tokens)")
    ap.add_argument("--gpu-counts", type=lambda s: [int(v) for v in s.split(",")], default=None)
    ap.add_argument("--seqs-per-device", type=lambda s: [int(v) for v in s.split(",")],
                    default=None)
    ap.add_argument("--moe-tokens", type=lambda s: [int(v) for v in s.split(",")], default=None)
    ap.add_argument("--logit-tol", type=float, default=None,
                    help="max |dlogit| / max |logit| allowed (default 1e-4 f32, 3e-2 bf16)")
    ap.add_argument("--moe-tol", type=float, default=2e-2,
                    help="moe_layer: max error vs the single-device layer (bf16)")
    ap.add_argument("--equal-f32", action="store_true",
                    help="equal section in float32 with exact token checks (GPU default: bf16)")
    ap.add_argument("--tie-tol", type=float, default=0.05,
                    help="bf16: logprob gap below which a greedy divergence is a near tie")
    ap.add_argument("--multihost-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in args.sections if s not in SECTIONS]
    if bad:
        ap.error(f"unknown sections {bad}; choose from {SECTIONS}")
    args.preset = args.preset or ("tiny" if args.quick else "mini")
    args.reps = args.reps or (3 if args.quick else 10)
    args.logit_tol = (args.logit_tol if args.logit_tol is not None
                      else 1e-4 if args.quick or args.equal_f32 else 3e-2)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.multihost_worker:
        multihost_worker()
        return 0
    set_up_environment(args.quick)
    sys.path.insert(0, ROOT)
    import jax
    jax.config.update("jax_compilation_cache_dir", os.path.join(ROOT, ".jax_cache"))
    devices = jax.devices()
    n, platform = len(devices), devices[0].platform
    name = devices[0].device_kind.split()[-1].lower() if platform == "gpu" else platform
    args.out = args.out or os.path.join(ROOT, "benchmarks", "results",
                                        f"multi_gpu_{name}x{n}.json")
    res = {"devices": [str(d) for d in devices], "device_kind": devices[0].device_kind,
           "platform": platform, "n_devices": n, "jax": jax.__version__, "quick": args.quick,
           "note": ("CPU fake devices: timings only show the code runs" if platform == "cpu"
                    else "measured on the listed devices"),
           "env": {k: os.environ.get(k) for k in MULTICAST_OFF}, "section_seconds": {}}
    print(f"{n} x {devices[0].device_kind} ({platform}); sections {args.sections}", flush=True)
    budgets = section_budgets(args.budget, args.sections)
    failed = []

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1,
                      default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))

    for name in args.sections:
        t0 = time.perf_counter()
        try:
            RUNNERS[name](args, Budget(budgets[name], save), res)
        except Exception as e:           # one section's failure does not stop the others
            import traceback
            traceback.print_exc()
            res[name] = {**res.get(name, {}), "error": f"{type(e).__name__}: {e}"}
            failed.append(name)
        res["section_seconds"][name] = time.perf_counter() - t0
        if res.get(name, {}).get("ok") is False:
            failed.append(name)
        save()
        print(f"[{name}: {res['section_seconds'][name]:.1f} s] wrote {args.out}", flush=True)
    if failed:
        print(f"FAIL: {failed}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
