"""Where one decode step's time goes: per-kernel device times from a `jax.profiler` trace of
`generate`'s decode loop, grouped by kernel name, by kind and by the model source line of the
HLO op each kernel runs (`by_source`, from the "XLA Ops" trace line and the program's HLO).

    python benchmarks/profile_step.py --preset mini --batch 1 --context 4096 --out FILE.json
    python benchmarks/profile_step.py --preset mini --batch 1 --prefill 4096 --out FILE.json

The profiler switches XLA's command buffers off, so launch gaps are overstated; the kernel
durations themselves are what this reports (`busy_ms_per_step`), beside the plain wall time of
the same loop without the profiler (`wall_ms_per_step`).
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import gzip
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

import deepinfer_fn as di
from benchmarks.decode import device_params, filled_state
from deepinfer_fn.generate import decode_block, stop_array
from deepinfer_fn.model.transformer import forward_chunk
from deepinfer_fn.sampling import sampling_params
from deepinfer_fn.state import init_state

# Mosaic first: the project's kernels carry names such as decode_gemm or grouped_gemm.
KINDS = (("mosaic", ("mosaic", "mgpu", "pallas", "decode_gemm", "grouped_gemm", "mhc_pre",
                     "mhc_post", "mhc_sinkhorn", "mhc_gates", "flash_decode", "compressor_decode")),
         ("gemm", ("gemm", "cublas", "cutlass", "sm90_xmma", "matmul", "dot")),
         ("sort/topk", ("sort", "topk", "top_k")),
         ("copy/dus", ("copy", "dynamic_update_slice", "dynamic-update-slice", "memcpy",
                       "memset")),
         ("scatter/gather", ("scatter", "gather")),
         ("reduce", ("reduce", "reduction")),
         ("fusion", ("fusion", "loop_", "input_")))


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def device_events(xspace_path: str, plane_prefix: str = "/device:GPU", ops: bool = False):
    """(name, duration_ns) of every event on the device planes of a trace: the kernels of the
    stream lines, or (ops=True) the HLO ops of the "XLA Ops" line."""
    from jax.profiler import ProfileData
    data = ProfileData.from_file(xspace_path)
    for plane in data.planes:
        if not plane.name.startswith(plane_prefix):
            continue
        for line in plane.lines:
            # XLA ops lines repeat the kernels' time as HLO ops; keep the stream lines.
            is_ops = "XLA Ops" in line.name
            if is_ops != ops or "XLA Modules" in line.name or "Steps" in line.name:
                continue
            for ev in line.events:
                yield ev.name, ev.duration_ns


def by_source(op_events, hlo_text: str, steps: int, top: int = 60) -> list[dict]:
    """Device time per model source line (`file:line <- caller:line`) of the HLO ops in
    op_events (name, ns); events the HLO does not name (library kernels) go by their name."""
    from benchmarks import hlo_count
    mod = hlo_count.parse(hlo_text)
    where = {}
    for comp in mod.computations.values():
        for ins in comp:
            where[ins.name] = hlo_count.source_line(ins, mod)
    acc = collections.defaultdict(lambda: [0, 0.0])
    for name, ns in op_events:
        key = name.split(" ")[0].lstrip("%")
        dotted = key.rsplit("_", 1)[0] + "." + key.rsplit("_", 1)[-1] if "_" in key else key
        src = where.get(key) or where.get(dotted) or f"kernel {key[:60]}"
        acc[src][0] += 1
        acc[src][1] += ns
    rows = sorted(acc.items(), key=lambda kv: -kv[1][1])
    return [{"source": k, "calls_per_step": n / steps, "us_per_step": ns / steps / 1e3}
            for k, (n, ns) in rows[:top]]


def summarize(events, steps: int, top: int = 40) -> dict:
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for name, ns in events:
        by_name[name][0] += 1
        by_name[name][1] += ns
    total_ns = sum(v[1] for v in by_name.values())
    kinds = collections.defaultdict(lambda: [0, 0.0])
    for name, (n, ns) in by_name.items():
        kinds[kind_of(name)][0] += n
        kinds[kind_of(name)][1] += ns
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    return {
        "kernels_per_step": sum(v[0] for v in by_name.values()) / steps,
        "busy_ms_per_step": total_ns / steps / 1e6,
        "by_kind": {k: {"kernels_per_step": n / steps, "ms_per_step": ns / steps / 1e6}
                    for k, (n, ns) in sorted(kinds.items(), key=lambda kv: -kv[1][1])},
        "top": [{"name": name[:160], "kind": kind_of(name), "calls_per_step": n / steps,
                 "us_per_step": ns / steps / 1e3} for name, (n, ns) in rows[:top]],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prefill", type=int, default=0,
                    help="profile one prefill chunk of this many tokens a row (empty state) "
                         "instead of decode steps")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default="benchmarks/results/profile_step.json")
    ap.add_argument("--plane", default="/device:GPU", help="trace plane prefix (CPU: /host:CPU)")
    ap.add_argument("--hlo-out", default=None,
                    help="also write the profiled program's optimized HLO here (.gz: gzipped)")
    args = ap.parse_args()
    cfg = di.ModelConfig.preset(args.preset)
    dtype = jnp.dtype(args.dtype)
    params = device_params(cfg, dtype)
    B = args.batch
    if args.prefill:
        steps = 1
        ids = jax.random.randint(jax.random.key(2), (B, args.prefill), 0, cfg.vocab_size)
        n_new = jnp.full((B,), args.prefill, jnp.int32)

        @functools.partial(jax.jit, donate_argnums=(1,))
        def program(params, state, ids, n_new):
            logits, state, _ = forward_chunk(params, state, ids, n_new)
            return logits, state

        def fresh():
            return init_state(cfg, B, max(args.context, args.prefill), dtype=dtype)

        def run(state):
            out = program(params, state, ids, n_new)
            jax.block_until_ready(out)
            return fresh()
        state = fresh()
        lowered = program.lower(params, state, ids, n_new)
    else:
        steps = args.steps
        logits = jnp.zeros((B, cfg.vocab_size), jnp.float32)
        done = jnp.zeros((B,), bool)
        sampling, pad, stops = sampling_params(B), jnp.int32(0), stop_array(())

        def run(state):
            out = decode_block(params, state, logits, done, sampling, pad, n=steps,
                               stops=stops, feed_last=True)
            jax.block_until_ready(out)
            return out[3]
        state = filled_state(cfg, B, args.context, dtype)
        lowered = decode_block.lower(params, state, logits, done, sampling, pad, n=steps,
                                     stops=stops, feed_last=True)
    # The same program: its op names are the names in the trace's "XLA Ops" line.
    hlo_text = lowered.compile().as_text()
    if args.hlo_out:
        opener = gzip.open if args.hlo_out.endswith(".gz") else open
        with opener(args.hlo_out, "wt") as f:
            f.write(hlo_text)
    t0 = time.perf_counter()
    state = run(state)                           # compile + warm up
    first_s = time.perf_counter() - t0
    state = run(state)
    t0 = time.perf_counter()
    state = run(state)
    wall_ms = (time.perf_counter() - t0) / steps * 1e3
    trace_dir = tempfile.mkdtemp(prefix="profile_step_")
    with jax.profiler.trace(trace_dir):
        state = run(state)
    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise SystemExit(f"no xplane.pb under {trace_dir}")
    summary = summarize(device_events(paths[0], args.plane), steps)
    op_events = list(device_events(paths[0], args.plane, ops=True))
    # Without an "XLA Ops" line, XLA's own kernels carry their fusion's name ("_N" for ".N").
    sources = by_source(op_events or device_events(paths[0], args.plane), hlo_text, steps)
    result = {"preset": args.preset, "batch": B, "context": args.context, "steps": steps,
              "prefill_tokens": args.prefill, "dtype": args.dtype,
              "device": jax.devices()[0].device_kind,
              "kernels_env": os.environ.get("DEEPINFER_KERNELS", ""),
              "first_call_s": first_s, "wall_ms_per_step": wall_ms, **summary,
              "by_source": sources}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    what = f"prefill {B}x{args.prefill}" if args.prefill else f"B={B} ctx={args.context}"
    print(f"{args.preset} {what}: first call {first_s:.1f} s; wall {wall_ms:.3f} ms/step, busy "
          f"{summary['busy_ms_per_step']:.3f} ms in {summary['kernels_per_step']:.0f} kernels")
    for k, v in summary["by_kind"].items():
        print(f"  {k:15s} {v['kernels_per_step']:7.1f} kernels {v['ms_per_step']:.3f} ms")
    for row in summary["top"][:15]:
        print(f"  {row['us_per_step']:8.1f} us  x{row['calls_per_step']:.1f}  {row['name'][:90]}")
    for row in sources[:25]:
        print(f"  {row['us_per_step']:8.1f} us  x{row['calls_per_step']:.1f}  {row['source'][:100]}")


if __name__ == "__main__":
    main()
