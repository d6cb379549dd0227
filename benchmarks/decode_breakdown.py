"""Where a decode step's time goes: one jitted `forward_chunk` step dispatched back to back
from Python vs the same step inside the `generate` while-loop, plus the number of kernels
(HLO fusions / custom calls) in the compiled step.

    python benchmarks/decode_breakdown.py --batch 16 --context 4096
"""

import argparse
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

import deepinfer_fn as di
from benchmarks.decode import device_params, filled_state
from deepinfer_fn.model import transformer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out", default="benchmarks/results/decode_breakdown.json")
    args = ap.parse_args()
    cfg = di.ModelConfig.preset(args.preset)
    params = device_params(cfg)
    B = args.batch

    @jax.jit
    def one_step(params, state, token):
        logits, state, _ = transformer.forward_chunk(params, state, token[:, None],
                                                     jnp.ones((B,), jnp.int32))
        return jnp.argmax(logits, -1).astype(jnp.int32), state

    state = filled_state(cfg, B, args.context, params.dtype)
    token = jnp.zeros((B,), jnp.int32)
    compiled = one_step.lower(params, state, token).compile()
    text = compiled.as_text()
    n_fusions = len(re.findall(r"^\s*ROOT|= .*fusion\(", text, re.M))
    n_custom = len(re.findall(r"custom-call\(", text))
    n_ops = sum(1 for line in text.splitlines() if " = " in line and "ENTRY" not in line)
    token, state = one_step(params, state, token)
    jax.block_until_ready(token)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        token, state = one_step(params, state, token)
    jax.block_until_ready(token)
    eager_ms = (time.perf_counter() - t0) / args.steps * 1e3

    from deepinfer_fn.generate import decode_block, stop_array
    from deepinfer_fn.sampling import sampling_params
    logits = jnp.zeros((B, cfg.vocab_size), jnp.float32)
    run = lambda st, lg: decode_block(params, st, lg, jnp.zeros((B,), bool), sampling_params(B),
                                       jnp.int32(0), n=args.steps, stops=stop_array(()), feed_last=True)
    out = run(state, logits)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    out = run(out[3], out[4])
    jax.block_until_ready(out)
    loop_ms = (time.perf_counter() - t0) / args.steps * 1e3
    res = dict(batch=B, context=args.context, device=jax.devices()[0].device_kind,
               step_dispatched_from_python_ms=eager_ms, step_in_while_loop_ms=loop_ms,
               hlo_fusions=n_fusions, hlo_custom_calls=n_custom, hlo_instructions=n_ops)
    print(json.dumps(res, indent=1), flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
