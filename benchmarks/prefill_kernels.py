"""The `mini` prefill with and without the prefill kernels (`chunk_attention`, `index_scores`
on Mosaic GPU against their XLA references), in one process with the same random weights:
one chunk from an empty state, compile seconds and the median of 5 runs, against the bf16
matmul peak measured in the same run (FLOPs as `lean.py` counts them: matmuls + attention).
With both arms, the XLA rows also give the kernels' logits against XLA's (relative L2 error,
argmax agreement).

    python benchmarks/prefill_kernels.py --shapes 1x4096,8x512 --out FILE.json
    python benchmarks/prefill_kernels.py --shapes 1x4096 --arms kernels --out FILE.json
    python benchmarks/prefill_kernels.py --preset tiny --shapes 1x64 --out FILE.json   # CPU

On a machine without an sm_90 GPU the "kernels" arm falls back to XLA (both arms equal).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import deepinfer_fn as di  # noqa: E402
from benchmarks import lean  # noqa: E402
from deepinfer_fn import kernels  # noqa: E402

OPS = ("chunk_attention", "index_scores")


def run_arm(cfg, params, token_map, impl: str, batch: int, tokens: int, peak: float,
            ops: tuple[str, ...] = OPS) -> dict:
    """One arm: `ops` on `impl`, the other prefill ops of OPS on XLA."""
    with contextlib.ExitStack() as stack:
        for op in OPS:
            stack.enter_context(kernels.use(op, impl if op in ops else "xla"))
        fn = jax.jit(lean.prefill_fn(token_map))
        state = di.init_state(cfg, batch, tokens + 256, dtype=jnp.bfloat16)
        ids = jax.random.randint(jax.random.key(2), (batch, tokens), 0, cfg.vocab_size, jnp.int32)
        t0 = time.perf_counter()
        compiled = fn.lower(params, state, ids).compile()
        compile_s = time.perf_counter() - t0
    logits, _ = compiled(params, state, ids)
    jax.block_until_ready(logits)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(params, state, ids))
        times.append(time.perf_counter() - t0)
    sec = sorted(times)[len(times) // 2]
    flops = lean.prefill_flops(cfg, batch, tokens, capacity=tokens + 256)
    return dict(arm="kernels" if impl == "mosaic_gpu" else "xla", batch=batch, tokens=tokens,
                ms=sec * 1e3, peak_ratio=flops["total"] / sec / peak, compile_s=compile_s,
                peak_flops_per_s=peak,
                logits_sum=float(jnp.sum(logits.astype(jnp.float32)))), logits


def agreement(a, b) -> dict:
    """Relative L2 error of logits a against b and the share of positions with equal argmax."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    rel = jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30)
    top1 = jnp.mean(jnp.argmax(a, -1) == jnp.argmax(b, -1))
    return dict(logits_rel_err=float(rel), top1_agreement=float(top1))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--shapes", default="1x4096,8x512", help="BxS prefill chunks")
    ap.add_argument("--peak-n", type=int, default=8192, help="matmul size of the peak measurement")
    ap.add_argument("--arms", default="kernels,xla", help="kernels (Mosaic GPU), xla, or both")
    ap.add_argument("--ops", default=",".join(OPS),
                    help="the prefill ops the kernels arm runs on Mosaic GPU (the rest on XLA)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    impls = {"kernels": "mosaic_gpu", "xla": "xla"}
    arms = [impls[a] for a in args.arms.split(",")]
    ops = tuple(o for o in args.ops.split(",") if o)
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        ap.error(f"--ops: unknown prefill ops {unknown}; choose from {list(OPS)}")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    cfg = di.ModelConfig.preset(args.preset)
    peak = lean.matmul_peak(jax, args.peak_n, 20)
    params = lean.random_weights(cfg, jnp.bfloat16)
    token_map = lean.token_map_for(cfg)[1]
    rows = []
    result = dict(device=jax.devices()[0].device_kind, command=" ".join(sys.argv), rows=rows)
    logits = {}
    for impl in arms:
        for batch, tokens in shapes:
            row, out = run_arm(cfg, params, token_map, impl, batch, tokens, peak, ops)
            if impl == "mosaic_gpu":
                row["ops"] = list(ops)
                logits[batch, tokens] = out       # kept for the XLA arm's comparison
            elif (batch, tokens) in logits:
                row.update(agreement(logits.pop((batch, tokens)), out))
            rows.append(row)
            print(json.dumps(rows[-1]), flush=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
