"""The prefill with `chunk_attention`'s query prepared in the flash kernel (head RMS factor and
rotation in shared memory) against the query folded by XLA first (`folded_query`: one read
for the factors, an in-place rewrite of the rotated channels), in one process: both programs
compiled with the same random weights, then timed in alternating rounds (5 runs a round), and
their logits compared.

    python benchmarks/prefill_query_ab.py --shapes 1x4096,8x512 --out FILE.json
    python benchmarks/prefill_query_ab.py --preset tiny --shapes 1x64 --out FILE.json   # CPU

On a machine without an sm_90 GPU both arms run the XLA reference (equal results).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import deepinfer_fn as di  # noqa: E402
from benchmarks import lean  # noqa: E402
from custom_calls import chunk_attention  # noqa: E402

ARMS = {"in_kernel": True, "folded": False}


def compile_arms(cfg, params, token_map, batch: int, tokens: int):
    """{arm: compiled prefill} and the (state, ids) they run on."""
    state = di.init_state(cfg, batch, tokens + 256, dtype=jnp.bfloat16)
    ids = jax.random.randint(jax.random.key(2), (batch, tokens), 0, cfg.vocab_size, jnp.int32)
    compiled = {}
    before = chunk_attention.PREPARE_QUERY_IN_KERNEL
    try:
        for arm, in_kernel in ARMS.items():
            chunk_attention.PREPARE_QUERY_IN_KERNEL = in_kernel    # read while tracing
            compiled[arm] = jax.jit(lean.prefill_fn(token_map)).lower(params, state, ids).compile()
    finally:
        chunk_attention.PREPARE_QUERY_IN_KERNEL = before
    return compiled, state, ids


def time_arms(compiled, params, state, ids, rounds: int, runs: int = 5) -> dict:
    """Milliseconds a prefill, one value a round per arm; the arms' order alternates."""
    times = {arm: [] for arm in compiled}
    order = list(compiled)
    for r in range(rounds):
        for arm in (order if r % 2 == 0 else order[::-1]):
            t0 = time.perf_counter()
            for _ in range(runs):
                out = compiled[arm](params, state, ids)
            jax.block_until_ready(out)
            times[arm].append((time.perf_counter() - t0) / runs * 1e3)
    return times


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--shapes", default="1x4096,8x512", help="BxS prefill chunks")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    cfg = di.ModelConfig.preset(args.preset)
    params = jax.block_until_ready(lean.random_weights(cfg, jnp.bfloat16))
    token_map = lean.token_map_for(cfg)[1]
    rows = []
    for shape in args.shapes.split(","):
        batch, tokens = (int(v) for v in shape.split("x"))
        compiled, state, ids = compile_arms(cfg, params, token_map, batch, tokens)
        logits = {arm: np.asarray(fn(params, state, ids)[0], np.float64)
                  for arm, fn in compiled.items()}
        times = time_arms(compiled, params, state, ids, args.rounds)
        ref = logits["folded"]
        row = dict(batch=batch, tokens=tokens, ms=times,
                   median_ms={arm: float(np.median(t)) for arm, t in times.items()},
                   logits_rel_diff=float(np.linalg.norm(logits["in_kernel"] - ref)
                                         / max(np.linalg.norm(ref), 1e-30)),
                   top1_agreement=float(np.mean(logits["in_kernel"].argmax(-1)
                                                == ref.argmax(-1))))
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = dict(command=" ".join(["benchmarks/prefill_query_ab.py"] + (argv or sys.argv[1:])),
                  preset=args.preset,
                  device=jax.devices()[0].device_kind, rows=rows)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
