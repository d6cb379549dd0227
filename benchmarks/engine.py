"""Offline engine throughput with and without the prefix cache, and device idle time between
steps with and without asynchronous scheduling.

Workload: `--requests` requests, each = one of `--systems` shared system prompts of
`--system-len` tokens + a distinct user suffix of `--suffix-min`..`--suffix-max` tokens,
`--new` generated tokens each (greedy, no stop token: every request generates exactly --new).
Random token ids; random weights (`mini`, bf16, generated on the device) or, with --quick,
the embedded default model on the CPU with a small workload.

Runs (one process, one compiled set of sub-step shapes, `Engine.warmup()` before timing):
  no_cache  : prefix cache off, async scheduling on
  cache     : prefix cache on (bounded replay R = --replay), async on
  cache_sync: prefix cache on, async off
Each run: wall time, generated tokens/s, steps, prefill tokens computed / saved, prefill FLOPs
saved (2 x active params x saved tokens), TTFT / TPOT percentiles, and device idle between
steps (Engine(measure_idle=True): max(0, dispatch of step s+1 - completion of step s), a
background thread timestamps completions).

    python benchmarks/engine.py --out benchmarks/results/engine_mini_h200.json      # GPU
    python benchmarks/engine.py --quick --out benchmarks/results/engine_quick_cpu.json

Speculative arms (`--speculative dspark|mtp`, docs/MODEL.md §D4): the embedded default model
(`--model default`, its shipped DSpark drafter or its MTP block) on `--requests` text prompts
(standard-library source windows of `--prompt-len` tokens, benchmarks/speculative.py's
`make_prompts`), `--new` tokens each (no stop token: fixed output length), `--max-batch` = the
concurrency (the engine refills a finished slot from the queue: a closed loop while requests
wait). Arms, one process, prefix cache on, async on: `plain` (no speculation; skip with
--no-plain) and one per `--verify-len` value (fixed, dynamic). Fixed and dynamic compile the
verify forward at the same `--verify-widths` (one shared decode program, identical buckets).
The dynamic arm's cost profile: `--cost-file` (a `VerifyCost` JSON, e.g. from
benchmarks/speculative.py --only-cost) or measured here at the decode bucket(s) and saved next
to --out; its step overhead (draft, sampling, bookkeeping) is `--overhead` or, when the fixed
arm ran first, its mean step time minus the profile's verify time at 1 + γ columns. Every arm
is warmed up (all shapes compiled) before it is timed; `--repeats` > 1 interleaves the arms.
Reported per arm: generated tok/s (real, tokens returned / wall) next to the "all drafts
accepted" figure (row-steps x (1 + γ) / wall) and verified tokens/s, mean verify length,
acceptance rate, tau; summary: dynamic / fixed and fixed / plain throughput ratios.

    python benchmarks/engine.py --model default --speculative dspark --verify-len fixed,dynamic \
        --max-batch 16 --decode-buckets 16 --out benchmarks/results/engine_spec_n16_h200.json
    python benchmarks/engine.py --quick --speculative dspark --verify-len fixed,dynamic \
        --out benchmarks/results/engine_spec_quick_cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

import deepinfer_fn as di
from deepinfer_fn.engine import Engine, Request


def add_workload_args(ap, *, prefill_shapes: str, decode_buckets: str) -> None:
    """The workload and engine-shape flags `workload` and the engine set-up read (shared with
    benchmarks/engine_host.py)."""
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--systems", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=2048)
    ap.add_argument("--suffix-min", type=int, default=32)
    ap.add_argument("--suffix-max", type=int, default=160)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--budget", type=int, default=4096, help="max_tokens_per_step")
    ap.add_argument("--prefill-shapes", default=prefill_shapes,
                    help="rows x width prefill sub-batch shapes")
    ap.add_argument("--decode-buckets", default=decode_buckets)
    ap.add_argument("--replay", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)


def workload(args, vocab: int):
    rng = np.random.default_rng(args.seed)
    systems = [rng.integers(2, vocab, args.system_len).tolist() for _ in range(args.systems)]
    reqs = []
    for i in range(args.requests):
        suffix = rng.integers(2, vocab, int(rng.integers(args.suffix_min, args.suffix_max + 1)))
        reqs.append(Request(systems[i % args.systems] + suffix.tolist(),
                            max_new_tokens=args.new, request_id=i))
    return reqs


def pct(xs, q):
    xs = [x for x in xs if np.isfinite(x)]
    return float(np.percentile(xs, q)) if xs else float("nan")


def run(engine: Engine, reqs, label: str) -> dict:
    engine.reset_cache()
    spec = engine.gamma > 0
    t0 = time.perf_counter()
    outs = engine.generate(reqs)
    wall = time.perf_counter() - t0
    m = engine.last_run
    bad = [o for o in outs if o.finish_reason != "length"]
    if bad:
        raise RuntimeError(f"{label}: {len(bad)} requests ended with {bad[0].finish_reason}: {bad[0].error}")
    ttft = [o.metrics.ttft for o in outs]
    tpot = [o.metrics.tpot for o in outs]
    res = dict(label=label, **dataclasses.asdict(m),
               ttft_p50_s=pct(ttft, 50), ttft_p90_s=pct(ttft, 90),
               tpot_p50_s=pct(tpot, 50), tpot_p90_s=pct(tpot, 90),
               total_tokens_per_s=(m.prompt_tokens + m.generated_tokens) / wall)
    print(f"{label:>11}: {wall:7.2f} s  {m.throughput_tokens_per_s:9.1f} gen tok/s  "
          f"{res['total_tokens_per_s']:10.1f} tok/s (prompt+gen)  steps {m.steps:5d}  "
          f"prefill computed {m.prefill_tokens_computed:8d} saved {m.prefill_tokens_saved:8d}  "
          f"idle {m.idle_total_s * 1e3:8.1f} ms over {m.idle_steps_measured} gaps "
          f"(mean {m.idle_mean_s * 1e6:7.1f} us)  preempt {m.preemptions}", flush=True)
    if spec:
        print(f"{'':>11}  speculative: mean ell {m.mean_verify_len:.2f}  acceptance "
              f"{m.acceptance_rate:.3f}  tau {m.tau:.2f}  real {m.throughput_tokens_per_s:.1f} "
              f"tok/s vs all-accepted {m.all_accepted_tokens_per_s:.1f} tok/s, verified "
              f"{m.verified_tokens_per_s:.1f} tok/s", flush=True)
    return res, [o.tokens for o in outs]


def _write(args, out: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="CPU: embedded default model, small workload")
    add_workload_args(ap, prefill_shapes="16x256,8x512", decode_buckets="16,64")
    ap.add_argument("--runs", default="no_cache,cache,cache_sync")
    ap.add_argument("--out", default="benchmarks/results/engine.json")
    # speculative arms (module docstring)
    ap.add_argument("--model", choices=("mini", "default"), default="mini",
                    help="mini: --preset with random weights; default: the embedded default model")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                    help="default model dtype (default bfloat16 on an accelerator, float32 on CPU)")
    ap.add_argument("--speculative", choices=("dspark", "mtp"), default=None)
    ap.add_argument("--verify-len", default="fixed,dynamic", help="comma list: fixed, dynamic")
    ap.add_argument("--num-draft-tokens", type=int, default=3, help="MTP drafts per step")
    ap.add_argument("--verify-widths", default=None,
                    help="comma list of compiled verify column counts (default: where the "
                         "cost profile gets cheaper, schedule.column_buckets; fixed only: 1+γ)")
    ap.add_argument("--cost-file", default=None, help="VerifyCost JSON for the dynamic arm")
    ap.add_argument("--decode-steps", type=int, default=8,
                    help="Engine(decode_steps=): decode steps per device call")
    ap.add_argument("--overhead", type=float, default=None, help="dynamic arm step overhead (s)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--no-plain", action="store_true", help="skip the non-speculative arm")
    args = ap.parse_args()
    if args.speculative:
        return main_speculative(args)
    if args.quick:
        args.requests, args.systems, args.system_len = min(args.requests, 24), 2, 256
        args.suffix_min, args.suffix_max, args.new = 8, 40, 8
        args.max_batch, args.budget = 8, 256
        args.prefill_shapes, args.decode_buckets = "8x32,4x64", "8"
        params = di.load_params(di.default_model_path())
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from decode import device_params
        params = device_params(di.ModelConfig.preset(args.preset), jnp.bfloat16)
    cfg = params.config
    reqs = workload(args, cfg.vocab_size)
    max_len = args.system_len + args.suffix_max + args.new
    buckets = (tuple(tuple(int(v) for v in x.split("x")) for x in args.prefill_shapes.split(",")),
               tuple(int(x) for x in args.decode_buckets.split(",")))
    common = dict(max_batch=args.max_batch, max_tokens_per_step=args.budget,
                  prefill_shapes=buckets[0], decode_buckets=buckets[1], max_len=max_len,
                  replay_tokens=args.replay, progress=False, measure_idle=True,
                  decode_steps=args.decode_steps)
    print(f"{jax.devices()[0].device_kind}: {cfg.num_hidden_layers} layers, {len(reqs)} requests, "
          f"{args.systems} system prompts x {args.system_len} tokens + {args.suffix_min}-"
          f"{args.suffix_max}, {args.new} new tokens; max_batch {args.max_batch}, budget "
          f"{args.budget}, prefill shapes {buckets[0]}, decode buckets {buckets[1]}", flush=True)
    engine = Engine(params, prefix_cache=True, **common)
    compile_s = engine.warmup()
    print(f"warmup (compile {len(buckets[0]) + len(buckets[1])} sub-step shapes): {compile_s:.1f} s",
          flush=True)
    no_cache = None
    results, tokens = [], {}
    for label in args.runs.split(","):
        if label.startswith("no_cache"):
            if no_cache is None:        # same shapes: the compiled sub-steps are reused
                no_cache = Engine(params, prefix_cache=False, **common)
                no_cache._shapes_seen = set(engine._shapes_seen)
            eng = no_cache
        else:
            eng = engine
        eng.async_scheduling = not label.endswith("_sync")
        res, tokens[label] = run(eng, reqs, label)
        results.append(res)
        _write(args, dict(device=jax.devices()[0].device_kind, compile_s=compile_s,
                          results=results, partial=True))     # survives a later timeout
    same = {f"{a}=={b}": tokens[a] == tokens[b] for a in tokens for b in tokens if a < b}
    print("identical tokens across runs:", same)
    by = {r["label"]: r for r in results}
    summary = {}
    if "cache" in by and "no_cache" in by:
        summary["prefix_cache_speedup"] = by["no_cache"]["wall_s"] / by["cache"]["wall_s"]
    if "cache" in by and "cache_sync" in by:
        summary["async_speedup"] = by["cache_sync"]["wall_s"] / by["cache"]["wall_s"]
        summary["idle_ms_async"] = by["cache"]["idle_total_s"] * 1e3
        summary["idle_ms_sync"] = by["cache_sync"]["idle_total_s"] * 1e3
    print("summary:", json.dumps(summary))
    out = dict(device=jax.devices()[0].device_kind, platform=platform.platform(),
               jax=jax.__version__, preset="default_model" if args.quick else args.preset,
               args=vars(args), compile_s=compile_s, results=results, summary=summary,
               identical_tokens=same)
    _write(args, out)
    print("wrote", args.out)


def text_workload(args, params):
    """--requests text prompts of --prompt-len tokens (benchmarks/speculative.py)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from speculative import make_prompts
    rows = make_prompts(args.requests, args.prompt_len, seed=args.seed)
    return [Request(r.tolist(), max_new_tokens=args.new, temperature=args.temperature,
                    seed=i, request_id=i) for i, r in enumerate(rows)]


def main_speculative(args):
    from deepinfer_fn.speculative import schedule
    # persistent compile cache: a rerun (or the next concurrency's shared shapes) skips compiles
    jax.config.update("jax_compilation_cache_dir", os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    if args.quick:
        args.model, args.requests, args.prompt_len, args.new = "default", min(args.requests, 8), 48, 16
        args.max_batch, args.budget, args.prefill_shapes, args.decode_buckets = 4, 128, "4x32", "4"
    if args.model != "default":
        raise SystemExit("--speculative needs --model default (a drafter trained for it)")
    on_cpu = jax.default_backend() == "cpu"
    dtype = jnp.dtype(args.dtype or ("float32" if on_cpu else "bfloat16"))
    params = di.load_params(di.default_model_path(), dtype=dtype)
    cfg = params.config
    drafter = None
    if args.speculative == "dspark":
        from deepinfer_fn.speculative import load_dspark, default_dspark_path
        drafter = load_dspark(default_dspark_path(), params, dtype=dtype)
        gamma = drafter.config.block_size
    else:
        gamma = args.num_draft_tokens
    lens = [v.strip() for v in args.verify_len.split(",") if v.strip()]
    if args.speculative == "mtp" and lens != ["fixed"]:
        print("MTP: only the fixed arm (no confidence head)")
        lens = ["fixed"]
    reqs = text_workload(args, params)
    shapes = tuple(tuple(int(v) for v in x.split("x")) for x in args.prefill_shapes.split(","))
    buckets = tuple(int(x) for x in args.decode_buckets.split(","))
    max_len = -(-(args.prompt_len + args.new + gamma + 1) // 64) * 64
    common = dict(max_batch=args.max_batch, max_tokens_per_step=args.budget,
                  prefill_shapes=shapes, decode_buckets=buckets, max_len=max_len,
                  replay_tokens=args.replay, progress=False, measure_idle=True,
                  decode_steps=args.decode_steps)
    dev = jax.devices()[0].device_kind
    print(f"{dev}: default model ({dtype.name}), {args.speculative} γ={gamma}, {len(reqs)} "
          f"requests x {args.prompt_len} prompt + {args.new} new tokens (T={args.temperature}); "
          f"concurrency {args.max_batch}, budget {args.budget}, prefill {shapes}, decode "
          f"buckets {buckets}", flush=True)
    cost = None
    if "dynamic" in lens:
        if args.cost_file:
            cost = schedule.VerifyCost.load(args.cost_file)
        else:
            t0 = time.perf_counter()
            # the engine runs up to --decode-steps verify steps per device call: time the
            # verify forward inside a device loop then (as generate's loop runs it)
            cost = schedule.measure_verify_cost(params, list(buckets), gamma,
                                                context=args.prompt_len + args.new // 2,
                                                repeats=3 if on_cpu else 10, verbose=True,
                                                in_loop=20 if args.decode_steps > 1 else 0)
            path = os.path.splitext(args.out)[0] + "_verify_cost.json"
            cost.save(path)
            print(f"verify cost measured in {time.perf_counter() - t0:.1f} s -> {path}")
    if args.verify_widths:
        widths = tuple(int(w) for w in args.verify_widths.split(","))
    elif cost is not None:     # where the profile gets cheaper (as generate compiles them)
        widths = schedule.column_buckets(cost.step_seconds_for(buckets[-1]))
    else:
        widths = (gamma + 1,)
    print(f"verify widths compiled: {widths}", flush=True)
    arms = ([] if args.no_plain else ["plain"]) + [f"{args.speculative}_{v}" for v in lens]
    engines, compile_s = {}, {}
    for arm in arms:
        kw = {}
        if arm != "plain":
            kw = dict(speculative=args.speculative, verify_len="fixed", verify_widths=widths)
            kw.update(drafter=drafter) if drafter is not None else kw.update(num_draft_tokens=gamma)
        if arm.endswith("dynamic"):
            continue                      # built after the fixed arm (its overhead)
        engines[arm] = Engine(params, **common, **kw)
        compile_s[arm] = engines[arm].warmup()
        print(f"warmup {arm}: {compile_s[arm]:.1f} s", flush=True)
    results, tokens = [], {}
    summary = {}
    for rep_i in range(args.repeats):
        for arm in arms:
            if arm.endswith("dynamic") and arm not in engines:
                overhead = args.overhead
                fixed = next((r for r in results if r["label"].endswith("fixed")), None)
                if overhead is None and fixed is not None and fixed["steps"]:
                    # per verify step: an engine step's decode call runs mean_decode_steps
                    verify_steps = fixed["steps"] * max(1.0, fixed["mean_decode_steps"])
                    step_s = fixed["wall_s"] / verify_steps
                    overhead = max(0.0, step_s - float(cost.step_seconds_for(buckets[-1])[-1]))
                summary["dynamic_overhead_s"] = overhead = overhead or 0.0
                engines[arm] = Engine(params, **common, speculative=args.speculative,
                                      drafter=drafter, verify_len="dynamic",
                                      verify_cost=cost.with_overhead(overhead),
                                      verify_widths=widths)
                compile_s[arm] = engines[arm].warmup()
                print(f"warmup {arm}: {compile_s[arm]:.1f} s (overhead {overhead * 1e3:.2f} ms)",
                      flush=True)
            res, tokens[arm] = run(engines[arm], reqs, arm)
            res["repeat"] = rep_i
            results.append(res)
            _write(args, dict(device=dev, compile_s=compile_s, results=results, partial=True))
    by = {}
    for r in results:
        by.setdefault(r["label"], []).append(r["throughput_tokens_per_s"])
    med = {k: float(np.median(v)) for k, v in by.items()}
    fixed, dyn = f"{args.speculative}_fixed", f"{args.speculative}_dynamic"
    if fixed in med and "plain" in med:
        summary["fixed_over_plain"] = med[fixed] / med["plain"]
    if dyn in med and fixed in med:
        summary["dynamic_over_fixed"] = med[dyn] / med[fixed]
    summary["median_tokens_per_s"] = med
    if "plain" in tokens:
        summary["token_agreement_with_plain"] = {
            k: float(np.mean([a == b for x, y in zip(v, tokens["plain"]) for a, b in zip(x, y)]))
            for k, v in tokens.items() if k != "plain"}
    print("summary:", json.dumps(summary))
    out = dict(device=dev, platform=platform.platform(), jax=jax.__version__,
               model="default_model", dtype=dtype.name, speculative=args.speculative,
               gamma=gamma, verify_widths=widths, args=vars(args), compile_s=compile_s,
               verify_cost=None if cost is None else cost.to_json(), results=results,
               summary=summary)
    _write(args, out)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
