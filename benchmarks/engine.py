"""Offline engine throughput with and without the prefix cache, and device idle time between
steps with and without asynchronous scheduling (issue 5 benchmark).

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
               total_tokens_per_s=(m.prompt_tokens + m.generated_tokens) / wall,
               idle_fraction=m.idle_total_s / wall if np.isfinite(m.idle_total_s) else float("nan"))
    print(f"{label:>11}: {wall:7.2f} s  {m.throughput_tokens_per_s:9.1f} gen tok/s  "
          f"{res['total_tokens_per_s']:10.1f} tok/s (prompt+gen)  steps {m.steps:5d}  "
          f"prefill computed {m.prefill_tokens_computed:8d} saved {m.prefill_tokens_saved:8d}  "
          f"idle {m.idle_total_s * 1e3:8.1f} ms over {m.idle_steps_measured} gaps "
          f"(mean {m.idle_mean_s * 1e6:7.1f} us)  preempt {m.preemptions}", flush=True)
    return res, [o.tokens for o in outs]


def _write(args, out: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="CPU: embedded default model, small workload")
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--systems", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=2048)
    ap.add_argument("--suffix-min", type=int, default=32)
    ap.add_argument("--suffix-max", type=int, default=160)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--budget", type=int, default=4096, help="max_tokens_per_step")
    ap.add_argument("--prefill-shapes", default="16x256,8x512",
                    help="rows x width prefill sub-batch shapes")
    ap.add_argument("--decode-buckets", default="16,64")
    ap.add_argument("--replay", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", default="no_cache,cache,cache_sync")
    ap.add_argument("--out", default="benchmarks/results/engine.json")
    args = ap.parse_args()
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
                  replay_tokens=args.replay, progress=False, measure_idle=True)
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


if __name__ == "__main__":
    main()
