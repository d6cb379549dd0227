"""Where does compile time go? Times tracing+lowering and XLA compilation of the embedded default
model's verify forward (`forward_chunk`, all logits, batch B x S columns, decode state at a
short context) in this process's configuration, so that runs with different settings can be
compared side by side:

    python benchmarks/compile_probe.py --tag default
    DEEPINFER_KERNELS=grouped_matmul=xla,attention=xla,sparse_attention=xla \
        python benchmarks/compile_probe.py --tag xla-kernels
    XLA_FLAGS=--xla_gpu_autotune_level=0 python benchmarks/compile_probe.py --tag no-autotune

Appends one JSON line per run to --out (default benchmarks/results/compile_probe.jsonl).
Also counts the custom calls (Pallas/Mosaic kernels) in the lowered module.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

import deepinfer_fn as di
from deepinfer_fn.model import transformer
from deepinfer_fn.state import init_state

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tag", default="default")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--columns", type=int, default=6)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--preset", default="default", help="'default' (embedded model) or a config preset")
    ap.add_argument("--out", default=os.path.join(RESULTS, "compile_probe.jsonl"))
    args = ap.parse_args(argv)
    dtype = jnp.bfloat16
    if args.preset == "default":
        params = di.load_params(di.default_model_path(), dtype=dtype)
    else:
        params = di.init_params(di.ModelConfig.preset(args.preset), jax.random.key(0), dtype=dtype)
    cfg = params.config
    B, S = args.batch, args.columns
    state = init_state(cfg, B, args.context + S + 16, window_slots=cfg.sliding_window + S,
                       dtype=dtype)
    ids = jnp.zeros((B, S), jnp.int32)
    n_new = jnp.full((B,), S, jnp.int32)
    fwd = jax.jit(lambda p, s, i, n: transformer.forward_chunk(p, s, i, n, all_logits=True)[:2],
                  donate_argnums=(1,))
    t0 = time.perf_counter()
    lowered = fwd.lower(params, state, ids, n_new)
    t1 = time.perf_counter()
    text = lowered.as_text()
    n_custom = text.count("stablehlo.custom_call")
    n_mosaic = text.count("mosaic_gpu")
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    _, state = compiled(params, state, ids, n_new)
    jax.block_until_ready(state)
    t4 = time.perf_counter()
    rec = dict(tag=args.tag, device=str(jax.devices()[0].device_kind), preset=args.preset,
               batch=B, columns=S, lower_s=t1 - t0, compile_s=t3 - t2, first_run_s=t4 - t3,
               custom_calls=n_custom, mosaic_mentions=n_mosaic, hlo_chars=len(text),
               xla_flags=os.environ.get("XLA_FLAGS", ""),
               kernels=os.environ.get("DEEPINFER_KERNELS", ""))
    print(json.dumps(rec), flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
