"""Host overhead of the offline engine, measured on the CPU with the device step stubbed out.

The engine's step loop (schedule -> pack -> transfer -> jitted sub-step call -> commit_plan ->
collect the previous step's tokens) runs unchanged, but `step.substep` is replaced by a jitted
stand-in with the same signature and pytree inputs (the real params treedef, the real
PagedState) that only writes plausible tokens into `last_token`: device time ~ 0, so the wall
time per step is the host's. Reported per step, split by phase:

  schedule  Scheduler.schedule (admission, page allocation, prefill shape choice)
  pack      Scheduler.pack (numpy inputs of each sub-batch)
  transfer  the rest of Engine._dispatch (bucket choice, copy_to_host_async, ...); the
            host -> device copy of the packed inputs happens inside the call
  call      the jitted call itself (argument flattening + dispatch; the stand-in's
            execution too, ~0 unless --device-ms)
  commit    Scheduler.commit_plan (positions, prefix-cache inserts)
  collect   Engine._collect (device -> host tokens, commit_results, stream events)
  other     the rest of the loop (cancels, generator plumbing, metrics)

Modes:
  host      (default) the breakdown above, async and sync, + a cProfile of the async run
            (--profile N prints the top N functions by own time)
  overlap   the stand-in occupies the "device" for --device-ms per call (a host callback that
            sleeps, so it costs no host CPU): async wall/step should approach
            max(host, device), sync host + device
  dispatch  the REAL jitted sub-step (tiny preset on the CPU; --dispatch-preset mini on a
            GPU): time for the call to return (not to finish) vs the time to finish, and
            the issue rate of back-to-back calls, for the decode and prefill shapes

Workload (default, = benchmarks/engine.py on the H200): 512 requests = one of 4 shared system
prompts of 2048 tokens + a 32-160 token suffix, 64 new tokens, max_batch 64, budget 4096,
prefill shape 8x512, decode bucket 64, shapes of the `mini` preset (params leaves shrunk to
one element: the stand-in never reads them, only their flattening counts).

    python benchmarks/engine_host.py                       # host breakdown (~1 min on CPU)
    python benchmarks/engine_host.py --decode-steps 8      # ... with 8 decode steps per call
    python benchmarks/engine_host.py --mode overlap --device-ms 10
    python benchmarks/engine_host.py --mode dispatch
    python benchmarks/engine_host.py --quick               # fewer requests (smoke test)
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import functools
import io
import json
import os
import platform
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

import deepinfer_fn as di
from deepinfer_fn.engine import Engine
from deepinfer_fn.engine import engine as engine_mod
from benchmarks.engine import add_workload_args, workload  # the engine benchmark's request mix
from deepinfer_fn.engine.step import unpack
from deepinfer_fn.params import Params, is_spec, leaf_dtype, param_specs

STEP_FN = "substep_packed"      # the engine module's name for the jitted sub-step
MULTI_STEP_FN = "decode_steps_packed"   # ... and for several decode steps per call
PHASES = ("schedule", "pack", "transfer", "call", "commit", "collect", "other")


# ----------------------------------------------------------------------------- stand-ins
def shrunk_params(cfg, dtype=jnp.bfloat16) -> Params:
    """The real Params treedef (every weight of `cfg`), each leaf one element."""
    specs = param_specs(cfg, include_mtp=False)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    return Params(jax.tree.unflatten(treedef, [jnp.zeros((1,), leaf_dtype(s, dtype))
                                                for s in leaves]), cfg)


SPIN_N = 256


def _spin_value(k, x):
    """k chained [SPIN_N, SPIN_N] matmuls seeded by the scalar x: a data-dependent device
    computation of known cost. (XLA:CPU runs programs it deems cheap, e.g. a scalar loop or
    a host callback, inline in the calling thread; a matmul loop is dispatched
    asynchronously like on a GPU.)"""
    a = jnp.full((SPIN_N, SPIN_N), 1.0 / SPIN_N, jnp.float32) + 0 * x
    return jax.lax.fori_loop(0, k, lambda i, v: v @ a, a)[0, 0]


_spin = jax.jit(_spin_value)


def spin_iters_for(ms: float) -> int:
    """Iterations of `_spin_value` that take ~ms on this CPU (calibrated, best of 5)."""
    n, x = 20, jnp.ones((), jnp.float32)
    _spin(n, x).block_until_ready()
    dts = []
    for _ in range(5):
        t0 = time.perf_counter()
        _spin(n, x).block_until_ready()
        dts.append(time.perf_counter() - t0)
    return max(1, round(n * ms / 1e3 / min(dts)))


def make_stub(vocab: int, device_ms: float = 0.0, spin_iters: int = 0):
    """A jitted stand-in for step.substep_packed: same signature, donation and outputs (state,
    int32 [B, 2] = token, logprob bits); tokens = a fixed function of the position.
    device_ms > 0: the computation waits that long in a host callback (a busy device that
    costs the host no CPU, but the callback needs the GIL to start); spin_iters > 0 instead:
    that many chained matmuls (`_spin_value`: no GIL, dispatched asynchronously; it occupies
    CPU cores, so the host competes with the "device" on a small machine)."""
    def wait(x):
        time.sleep(device_ms / 1e3)
        return x

    @functools.partial(jax.jit, donate_argnums=(1,))
    def stub(params, state, packed):
        meta, fparams, block_table, tokens = unpack(packed, state.max_pages)
        slot, start, n_new = meta[:, 0], meta[:, 1], meta[:, 2]
        tok = ((start + n_new) * 104729) % (vocab - 2) + 2
        if tokens is not None:
            tok = tok + 0 * tokens[:, 0]
        tok = tok + 0 * block_table[:, 0] + (fparams[:, 0] * 0).astype(jnp.int32)
        if spin_iters > 0:
            v = _spin_value(spin_iters + 0 * slot[0], tok[0].astype(jnp.float32))
            tok = tok + (v > 1e30).astype(tok.dtype)         # the tokens depend on the loop
        elif device_ms > 0:
            tok = jax.pure_callback(wait, jax.ShapeDtypeStruct(tok.shape, tok.dtype), tok)
        tok = tok.astype(jnp.int32)
        state = dataclasses.replace(state, last_token=state.last_token.at[slot].set(tok, mode="drop"))
        return state, jnp.stack([tok, jnp.zeros_like(tok)], axis=1)
    return stub


@functools.cache
def make_multi_stub(vocab: int):
    """A jitted stand-in for step.decode_steps_packed (several decode steps per call): out
    int32 [B, steps, 2], step i of row b = the token of position start + i + 1 while i <
    n_new (the same tokens `make_stub` gives one step at a time)."""
    @functools.partial(jax.jit, static_argnames=("steps",), donate_argnums=(1,))
    def stub(params, state, packed, *, steps):
        meta, fparams, block_table, _ = unpack(packed, state.max_pages)
        slot, start, n_new = meta[:, 0], meta[:, 1], meta[:, 2]
        i = jnp.arange(steps)[None]
        tok = ((start[:, None] + i + 1) * 104729) % (vocab - 2) + 2
        tok = tok + 0 * block_table[:, :1] + (fparams[:, :1] * 0).astype(jnp.int32)
        tok = jnp.where(i < n_new[:, None], tok, 0).astype(jnp.int32)
        last = jnp.take_along_axis(tok, jnp.maximum(n_new - 1, 0)[:, None], axis=1)[:, 0]
        slot = jnp.where(n_new > 0, slot, state.max_batch)
        state = dataclasses.replace(state, last_token=state.last_token.at[slot].set(last, mode="drop"))
        return state, jnp.stack([tok, jnp.zeros_like(tok)], axis=2)
    return stub


# ----------------------------------------------------------------------------- timing
class PhaseTimer:
    """Wraps the engine's phase functions with perf_counter accumulators."""

    def __init__(self):
        self.t = dict.fromkeys(PHASES, 0.0)
        self.n = dict.fromkeys(PHASES, 0)

    def wrap(self, phase, fn):
        t, n = self.t, self.n

        @functools.wraps(fn)
        def timed(*a, **k):
            n[phase] += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                t[phase] += time.perf_counter() - t0
        return timed

    def wrap_gen(self, phase, fn):
        t = self.t

        @functools.wraps(fn)
        def timed(*a, **k):
            it = fn(*a, **k)
            while True:
                t0 = time.perf_counter()
                try:
                    v = next(it)
                except StopIteration:
                    t[phase] += time.perf_counter() - t0
                    return
                t[phase] += time.perf_counter() - t0
                yield v
        return timed


def install(engine: Engine, stub, timer: PhaseTimer | None):
    """Points the engine at the stand-in (and the timers). Returns an undo function."""
    saved = []

    def patch(obj, name, new):
        saved.append((obj, name, vars(obj).get(name), name in vars(obj)))
        setattr(obj, name, new)

    call = stub if timer is None else timer.wrap("call", stub)
    patch(engine_mod, STEP_FN, call)
    multi = make_multi_stub(engine.cfg.vocab_size)
    patch(engine_mod, MULTI_STEP_FN, multi if timer is None else timer.wrap("call", multi))
    if timer is not None:
        sched = engine.scheduler
        patch(sched, "schedule", timer.wrap("schedule", sched.schedule))
        patch(sched, "pack", timer.wrap("pack", sched.pack))
        patch(sched, "commit_plan", timer.wrap("commit", sched.commit_plan))
        patch(engine, "_dispatch", timer.wrap("transfer", engine._dispatch))
        patch(engine, "_collect", timer.wrap_gen("collect", engine._collect))

    def undo():
        for obj, name, old, had in reversed(saved):
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)
    return undo


# ----------------------------------------------------------------------------- workload
def build_engine(args, params):
    shapes = tuple(tuple(int(v) for v in x.split("x")) for x in args.prefill_shapes.split(","))
    buckets = tuple(int(x) for x in args.decode_buckets.split(","))
    return Engine(params, max_batch=args.max_batch, max_tokens_per_step=args.budget,
                  prefill_shapes=shapes, decode_buckets=buckets,
                  max_len=args.system_len + args.suffix_max + args.new,
                  replay_tokens=args.replay, progress=False, decode_steps=args.decode_steps)


def timed_run(engine: Engine, reqs, stub, async_scheduling: bool, profile: bool = False):
    """(wall seconds, steps, phase seconds, decode rows/step, tokens, profile stats or None)."""
    timer = PhaseTimer()
    undo = install(engine, stub, timer)
    engine.async_scheduling = async_scheduling
    engine.reset_cache()
    prof = cProfile.Profile() if profile else None
    try:
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        outs = engine.generate(reqs)
        if prof:
            prof.disable()
        wall = time.perf_counter() - t0
    finally:
        undo()
    t = timer.t
    t["transfer"] -= t["pack"] + t["call"] + t["commit"]   # _dispatch = all four
    t["other"] = wall - sum(v for k, v in t.items() if k != "other")
    m = engine.last_run
    bad = [o for o in outs if o.finish_reason != "length"]
    assert not bad, (len(bad), bad[0].finish_reason, bad[0].error)
    t["_calls"] = timer.n["call"]
    return wall, m.steps, dict(t), m.mean_decode_occupancy * engine.max_batch, \
        [o.tokens for o in outs], prof


def mode_host(args, cfg, out):
    params = shrunk_params(cfg)
    engine = build_engine(args, params)
    stub = make_stub(cfg.vocab_size)
    # warm-up: compile the stand-in for every shape (a short run)
    small = argparse.Namespace(**{**vars(args), "requests": args.max_batch + 8, "new": 4})
    timed_run(engine, workload(small, cfg.vocab_size), stub, True)
    reqs = workload(args, cfg.vocab_size)
    res, toks = {}, {}
    for label, a in (("async", True), ("sync", False)):
        best = None
        for rep in range(args.repeats):
            wall, steps, t, dec, toks[label], _ = timed_run(engine, reqs, stub, a)
            if best is None or wall < best[0]:
                best = (wall, steps, t, dec)
        wall, steps, t, dec = best
        n_tok = sum(map(len, toks[label]))
        res[label] = dict(wall_s=wall, steps=steps, us_per_step=wall / steps * 1e6,
                          generated_tokens=n_tok, us_per_generated_token=wall / n_tok * 1e6,
                          decode_rows_per_step=dec,
                          calls_per_step=t["_calls"] / steps,
                          phases_us_per_step={k: t[k] / steps * 1e6 for k in PHASES})
        ph = "  ".join(f"{k} {t[k] / steps * 1e6:7.1f}" for k in PHASES)
        print(f"{label:>5}: {wall:6.2f} s  {steps} steps  {wall / steps * 1e6:8.1f} us/step  "
              f"{wall / n_tok * 1e6:6.1f} us/generated token  "
              f"(decode rows/step {dec:.1f})  per step [us]: {ph}", flush=True)
    res["async_tokens_equal_sync"] = toks["async"] == toks["sync"]
    print("async tokens == sync tokens:", res["async_tokens_equal_sync"])
    if args.profile:
        _, _, _, _, _, prof = timed_run(engine, reqs, stub, True, profile=True)
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.profile)
        print(s.getvalue())
        s2 = io.StringIO()
        pstats.Stats(prof, stream=s2).sort_stats("cumulative").print_stats(args.profile)
        print(s2.getvalue())
    out["host"] = res


def mode_overlap(args, cfg, out):
    params = shrunk_params(cfg)
    engine = build_engine(args, params)
    reqs = workload(args, cfg.vocab_size)
    small = argparse.Namespace(**{**vars(args), "requests": args.max_batch + 8, "new": 4})
    res = {}
    spin = spin_iters_for(args.device_ms) if args.device_kind == "spin" else 0
    for dms in (0.0, args.device_ms):
        stub = make_stub(cfg.vocab_size, dms, spin if dms else 0)
        timed_run(engine, workload(small, cfg.vocab_size), stub, True)   # compile
        for label, a in (("async", True), ("sync", False)):
            wall, steps, t, dec, _, _ = timed_run(engine, reqs, stub, a)
            calls = t.get("_calls", 0)
            key = f"{label}_device{dms:g}ms"
            res[key] = dict(wall_s=wall, steps=steps, us_per_step=wall / steps * 1e6,
                            calls_per_step=calls / steps,
                            device_ms_per_step=dms * calls / steps)
            print(f"device {dms:5.1f} ms/call ({args.device_kind}, {dms * calls / steps:5.2f} "
                  f"ms/step)  {label:>5}: {wall:6.2f} s  {steps} steps  "
                  f"{wall / steps * 1e3:7.2f} ms/step", flush=True)
    # each step is up to two device calls (prefill + decode): the stand-in's device time per
    # step is device_ms x calls/step
    out["overlap"] = res


def mode_dispatch(args, out):
    """The REAL jitted sub-step (step.substep_packed; --dispatch-preset, default tiny on the
    CPU, random weights): call-return time vs completion time, decode and prefill shapes."""
    from deepinfer_fn.engine.step import substep_packed
    cfg = di.ModelConfig.preset(args.dispatch_preset)
    if args.dispatch_preset == "tiny":
        params = di.init_params(cfg, jax.random.key(0), include_mtp=False)
        max_len, rows, width = 512, 8, 64
    else:                                   # GPU: random weights generated on the device
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from decode import device_params
        params = device_params(cfg, jnp.bfloat16)
        max_len = args.system_len + args.suffix_max + args.new
        rows, width = (int(v) for v in args.prefill_shapes.split(",")[0].split("x"))
    eng = Engine(params, max_batch=args.max_batch, max_tokens_per_step=max(512, rows * width),
                 max_len=max_len, prefill_shapes=((rows, width),),
                 decode_buckets=(args.max_batch,), progress=False)
    t0 = time.perf_counter()
    eng.warmup()
    print(f"{jax.devices()[0].device_kind}, preset {args.dispatch_preset}: compile "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    sched = eng.scheduler
    res = dict(preset=args.dispatch_preset)
    n_leaves = len(jax.tree.leaves((params, eng.state)))
    for name, (n, w) in (("decode", (args.max_batch, None)), ("prefill", (rows, width))):
        packed = sched.pack([], n, w)
        calls, dones = [], []
        for i in range(args.dispatch_iters):
            jax.block_until_ready(eng.state)
            t0 = time.perf_counter()
            eng.state, o = substep_packed(params, eng.state, packed)
            t1 = time.perf_counter()
            jax.block_until_ready(o)
            t2 = time.perf_counter()
            calls.append(t1 - t0)
            dones.append(t2 - t0)
        # back to back: the host issues calls without waiting (queue depth permitting)
        jax.block_until_ready(eng.state)
        t0 = time.perf_counter()
        for i in range(args.dispatch_iters):
            eng.state, o = substep_packed(params, eng.state, packed)
        t_issue = time.perf_counter() - t0
        jax.block_until_ready(eng.state)
        t_all = time.perf_counter() - t0
        res[name] = dict(call_return_us_median=float(np.median(calls) * 1e6),
                         call_return_us_min=float(np.min(calls) * 1e6),
                         finish_us_median=float(np.median(dones) * 1e6),
                         back_to_back_issue_us=t_issue / args.dispatch_iters * 1e6,
                         back_to_back_total_us=t_all / args.dispatch_iters * 1e6)
        r = res[name]
        print(f"real substep_packed {name:>7} {n}x{w or 1}: call returns in "
              f"{r['call_return_us_median']:9.1f} us (min {r['call_return_us_min']:.1f}), "
              f"finishes in {r['finish_us_median']:9.1f} us; back to back: issue "
              f"{r['back_to_back_issue_us']:9.1f} us/call, total {r['back_to_back_total_us']:9.1f}"
              f" us/call  ({n_leaves} argument leaves)", flush=True)
    t0 = time.perf_counter()
    for _ in range(1000):
        jax.tree.flatten((params, eng.state))
    res["flatten_us"] = (time.perf_counter() - t0) / 1000 * 1e6
    print(f"tree flatten (params, state): {res['flatten_us']:.1f} us")
    out["dispatch"] = res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="host", choices=("host", "overlap", "dispatch"))
    ap.add_argument("--quick", action="store_true")
    add_workload_args(ap, prefill_shapes="8x512", decode_buckets="64")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--profile", type=int, default=0, help="print the top N cProfile rows")
    ap.add_argument("--device-ms", type=float, default=10.0)
    ap.add_argument("--device-kind", default="spin", choices=("spin", "sleep"),
                    help="--mode overlap: an XLA spin loop or a sleeping host callback")
    ap.add_argument("--dispatch-iters", type=int, default=50)
    ap.add_argument("--dispatch-preset", default="tiny",
                    help="--mode dispatch: tiny (CPU) or mini (GPU, random device weights)")
    ap.add_argument("--decode-steps", type=int, default=1,
                    help="host mode: Engine(decode_steps=): decode steps per device call")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.requests = min(args.requests, 96)
    if args.mode != "host" and args.decode_steps != 1:
        ap.error("--decode-steps applies to --mode host (the other stand-ins run one step)")
    cfg = di.ModelConfig.preset(args.preset)
    out = dict(device=jax.devices()[0].device_kind, platform=platform.platform(),
               jax=jax.__version__, args=vars(args))
    if args.mode == "host":
        mode_host(args, cfg, out)
    elif args.mode == "overlap":
        mode_overlap(args, cfg, out)
    else:
        mode_dispatch(args, out)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print("wrote", args.out)


if __name__ == "__main__":
    main()
