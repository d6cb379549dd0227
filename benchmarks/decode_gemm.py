"""The decode projections' weight-streaming GEMM (custom_calls/dense.py) on its own: time per
call of each `mini` projection shape, at the planned tiles and at variants of them, against
the XLA reference and the HBM bandwidth measured in the same run.

Each call streams its weight out of a stack of R copies (> 256 MiB, so the 50 MiB L2 holds
none of it) inside one jitted `lax.scan`, as a scanned layer group reads its weights:

    python benchmarks/decode_gemm.py --batches 1,64 --out benchmarks/results/decode_gemm.json
    python benchmarks/decode_gemm.py --quick        # CPU smoke run (interpret mode, tiny shapes)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from custom_calls import dense
from deepinfer_fn.model.common import linear_xla

# (name, K, widths): one weight, or several read in one launch (`linear_many`), of `mini`.
MINI_SHAPES = (
    ("wq_b", 768, (16384,)),
    ("CSA input: wq_a wkv compressor index-compressor", 2048, (768, 512, 1024, 1024, 256, 256)),
    ("wo_b", 2048, (2048,)),
    ("MoE input: gate shared w1 w3", 2048, (64, 512, 512)),
    ("wq_a", 2048, (768,)),
    ("index wq_b", 768, (4096,)),
    ("shared w2", 512, (2048,)),
)
QUICK_SHAPES = (("tiny", 256, (128,)), ("tiny many", 256, (128, 64)))
STACK_BYTES = 256 * 2**20


def median_seconds(fn, reps: int) -> float:
    jax.block_until_ready(fn())
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def stacked_weights(k: int, widths, copies: int, key):
    """One [copies, K, N_j] bf16 stack per width."""
    keys = jax.random.split(key, len(widths))
    return [(jax.random.normal(kk, (copies, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
            for kk, n in zip(keys, widths)]


def scan_over_copies(project):
    """jit(x, stacks) -> the projections of x by every copy, one `project` call per copy."""
    def run(x, stacks):
        def body(c, ws):
            return c, project(x, list(ws))
        return jax.lax.scan(body, 0, tuple(stacks))[1]
    return jax.jit(run)


def kernel_project(cfg: dict, interpret: bool):
    def project(x, ws):
        if len(ws) == 1:
            return (dense.skinny_matmul(x[None], ws[0][None], interpret=interpret, **cfg)[0],)
        return dense.skinny_matmul_many(x, ws, interpret=interpret, **cfg)
    return project


def xla_project(x, ws):
    return tuple(linear_xla(x, w) for w in ws)


def variants(k: int, widths, num_sms: int) -> list[dict]:
    """The planned tiles first, then block_n x block_k x splits (1/4 to 2x the planned) x
    stages (2, 4; at most the K steps of a split), fewest changes first; only those whose
    shared memory fits a Hopper SM."""
    base = dense.plan(1, k, tuple(widths), num_sms=num_sms)
    out = []
    for bn, bk, scale, stages in itertools.product((64, 128), (64, 128), (1, 0.5, 0.25, 2),
                                                   (base["stages"], 2, 4)):
        splits = max(1, int(base["splits"] * scale))
        steps = k // bk
        if k % bk or any(w % bn for w in widths) or steps % splits:
            continue
        cfg = dict(block_n=bn, block_k=bk, splits=splits, stages=min(stages, steps // splits))
        if cfg["stages"] * (64 * bk + bk * bn) * 2 + 64 * bn * 4 > 220 * 1024 or cfg in out:
            continue
        out.append(cfg)
    changed = lambda c: sum(c[key] != base[key] for key in base)
    return sorted(out, key=changed)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--shapes", default=None, help="comma-separated indices into the shape list")
    ap.add_argument("--variants", type=int, default=12, help="tile variants per shape and batch")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds for the whole sweep")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: interpret mode, tiny")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    interpret = a.quick or not dense.on_hopper()
    if interpret and not a.quick:
        raise SystemExit("decode_gemm: needs an sm_90 GPU (or --quick for the CPU smoke run)")
    shapes = QUICK_SHAPES if a.quick else MINI_SHAPES
    if a.shapes:
        shapes = [shapes[int(i)] for i in a.shapes.split(",")]
    num_sms = 4 if interpret else dense.NUM_SMS
    stack_bytes = 2**20 if a.quick else STACK_BYTES

    n = stack_bytes // 4
    buf = jnp.ones((n,), jnp.float32)
    bump = jax.jit(lambda v: v + 1.0)
    bw = 2 * n * 4 / median_seconds(lambda: bump(buf), a.reps)
    del buf
    rows = []
    print(f"HBM bandwidth (x + 1 on {stack_bytes >> 20} MiB): {bw / 1e9:.0f} GB/s", flush=True)
    batches = [int(b) for b in a.batches.split(",")]
    for (name, k, widths), batch in itertools.product(shapes, batches):
        if time.perf_counter() - t_start > a.budget:
            print(f"budget of {a.budget:.0f} s spent: {name} at batch {batch} not measured")
            continue
        wbytes = k * sum(widths) * 2
        copies = max(2, stack_bytes // wbytes)
        stacks = stacked_weights(k, widths, copies, jax.random.key(len(rows)))
        x = jax.random.normal(jax.random.key(1), (batch, k), jnp.float32).astype(jnp.bfloat16)
        reference = scan_over_copies(xla_project)      # jitted once: timed calls reuse it
        want = reference(x, stacks)
        t_xla = median_seconds(lambda: reference(x, stacks), a.reps) / copies
        row = dict(shape=name, k=k, widths=list(widths), batch=batch, weight_bytes=wbytes,
                   copies=copies, roofline_us=wbytes / bw * 1e6, xla_us=t_xla * 1e6, tiles=[])
        for cfg in variants(k, widths, num_sms)[:a.variants]:
            if time.perf_counter() - t_start > a.budget:
                row["budget_hit"] = True
                break
            fn = scan_over_copies(kernel_project(cfg, interpret))
            try:
                got = fn(x, stacks)
                err = max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32))))
                          for g, w in zip(got, want))
                t = median_seconds(lambda: fn(x, stacks), a.reps) / copies
                row["tiles"].append(dict(cfg, us=t * 1e6, max_abs_err=err,
                                         of_bandwidth=wbytes / bw / t))
            except Exception as e:  # noqa: BLE001 - a variant that does not lower is a result
                row["tiles"].append(dict(cfg, error=f"{type(e).__name__}: {str(e)[:200]}"))
        ok = [v for v in row["tiles"] if "us" in v]
        if ok:
            best = min(ok, key=lambda v: v["us"])
            row["planned_us"] = row["tiles"][0].get("us")
            row["best"] = best
            print(f"{name:48s} B={batch:3d} {wbytes / 2**20:7.2f} MiB roofline "
                  f"{row['roofline_us']:6.1f} us  xla {row['xla_us']:6.1f}  planned "
                  f"{ok[0]['us']:6.1f}  best {best['us']:6.1f} "
                  f"({best['block_n']}x{best['block_k']} s{best['stages']} k/{best['splits']})",
                  flush=True)
        rows.append(row)
        del stacks
    out = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, hbm_Bps=bw,
               command="python benchmarks/decode_gemm.py " + " ".join(argv or sys.argv[1:]),
               rows=rows, seconds=time.perf_counter() - t_start)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
        print("wrote", a.out)
    return out


if __name__ == "__main__":
    main()
