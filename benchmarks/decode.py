"""Decode throughput of the `mini` preset against the HBM roofline, measured in one run.

For each (batch, context): a decode state filled to `context` tokens (random contents: decode
cost does not depend on the values), then `steps` greedy decode steps inside the same jitted
while-loop `generate` uses (`deepinfer_fn.generate.decode_block`). Reported per step: time,
tokens/s, the bytes that must move (weights read once per step: dense weights + the routed
experts the batch touches in expectation; state read: window rings, CSA selected rows and all
indexer rows, HCA rows, compressor buffers) and roofline time = bytes / HBM bandwidth measured
in the same run with a large on-device copy. achieved/roofline = roofline time / step time.
Kernels: the registry's choice per op is printed (mosaic_gpu where registered and on sm_90,
else xla); --xla forces every op to the XLA reference for comparison.

    python benchmarks/decode.py --out benchmarks/results/decode.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

import deepinfer_fn as di
from deepinfer_fn import kernels
from deepinfer_fn.config import CSA, HCA, SWA
from deepinfer_fn.generate import decode_block, stop_array
from deepinfer_fn.params import Params, is_spec, leaf_dtype, param_specs
from deepinfer_fn.sampling import sampling_params
from deepinfer_fn.state import init_state


def device_params(cfg, dtype=jnp.bfloat16, seed=0) -> Params:
    """Random weights generated on the device (fast for billions of parameters)."""
    specs = param_specs(cfg, include_mtp=False)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = []
    for spec, k in zip(leaves, keys):
        dt = leaf_dtype(spec, dtype)
        if spec.layout == "index":
            out.append(jax.random.randint(k, spec.shape, 0, cfg.n_routed_experts, jnp.int32))
        elif spec.ckpt.endswith("norm.weight") or spec.ckpt.endswith("_scale"):
            out.append(jnp.ones(spec.shape, dt))
        else:
            fan = spec.shape[-2] if len(spec.shape) >= 2 else 1
            out.append((jax.random.normal(k, spec.shape, jnp.float32) / math.sqrt(fan)).astype(dt))
    return Params(jax.tree.unflatten(treedef, out), cfg)


def filled_state(cfg, batch, context, dtype, seed=1):
    """A decode state holding `context` tokens per row (random rows, full window ring), in the
    params' layer grouping (stacked leaves of scanned groups: batch axis 1)."""
    st = init_state(cfg, batch, context + 256, dtype=dtype)
    keys = iter(jax.random.split(jax.random.key(seed), 4096))

    def fill(scanned, layer):
        new = {}
        for name, arr in layer.items():
            k = next(keys)
            if name == "window_pos":
                slots = arr.shape[-1]
                pos = context - slots + jnp.arange(slots)
                new[name] = jnp.broadcast_to(pos[jnp.argsort(pos % slots)], arr.shape).astype(jnp.int32)
            elif name.endswith("raw_gate"):
                new[name] = jax.random.normal(k, arr.shape, arr.dtype)
            else:
                new[name] = (0.5 * jax.random.normal(k, arr.shape, jnp.float32)).astype(arr.dtype)
        return new

    return type(st)(st.layers.map_blocks(fill), jnp.full((batch,), context, jnp.int32),
                    st.max_len, st.window_slots)


def step_bytes(cfg, batch, context, itemsize=2) -> dict:
    """Bytes one decode step must move from HBM (the roofline numerator)."""
    specs = param_specs(cfg, include_mtp=False)
    dense = experts = 0
    for s in jax.tree.leaves(specs, is_leaf=is_spec):
        n = math.prod(s.shape)
        if s.layout == "experts":
            experts += n
        elif s.layout == "index" or s.ckpt == "embed.weight":
            continue
        else:
            dense += n * (4 if s.keep_fp32 else itemsize)
    n_moe_layers = cfg.num_hidden_layers
    per_expert = experts // (cfg.n_routed_experts * n_moe_layers) * itemsize
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    touched = E * (1 - (1 - k / E) ** batch)          # distinct experts per layer (uniform routing)
    expert_bytes = n_moe_layers * touched * per_expert
    embed_rows = batch * cfg.hidden_size * itemsize
    state = 0
    d, dI = cfg.head_dim, cfg.index_head_dim
    for lt in cfg.layer_types:
        state += cfg.sliding_window * d * itemsize              # window ring
        if lt == CSA:
            rows = context // cfg.csa_ratio
            state += min(cfg.index_topk, rows) * d * itemsize   # selected main rows
            state += rows * dI * itemsize                       # every indexer row is scored
            state += cfg.csa_ratio * (2 * d + 2 * dI) * (itemsize + 4)  # partial buffers
        elif lt == HCA:
            state += context // cfg.hca_ratio * d * itemsize
            state += cfg.hca_ratio * d * (itemsize + 4)
    return {"weights_dense": dense, "weights_experts": int(expert_bytes), "embed_rows": embed_rows,
            "state": state * batch, "total": int(dense + expert_bytes + embed_rows + state * batch)}


def hbm_bandwidth(gib=4) -> float:
    n = gib * 2**30 // 4
    x = jnp.ones((n,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001)
    f(x).block_until_ready()
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * n * 4 / float(np.median(times))


def bench_point(params, batch, context, steps, reps):
    cfg = params.config
    state = filled_state(cfg, batch, context, params.dtype)
    logits = jnp.zeros((batch, cfg.vocab_size), jnp.float32)
    done = jnp.zeros((batch,), bool)
    sp = sampling_params(batch)
    pad = jnp.int32(0)
    run = lambda st, lg: decode_block(params, st, lg, done, sp, pad, n=steps, stops=stop_array(()),
                                       feed_last=True)
    t0 = time.perf_counter()
    out = run(state, logits)
    jax.block_until_ready(out)
    compile_s = time.perf_counter() - t0
    state, logits = out[3], out[4]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = run(state, logits)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
        state, logits = out[3], out[4]
    step_s = float(np.median(times)) / steps
    return step_s, compile_s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--xla", action="store_true", help="force every kernel op to the XLA reference")
    ap.add_argument("--compare-xla", default="", help="also run these batch:context points with --xla")
    ap.add_argument("--out", default="benchmarks/results/decode.json")
    args = ap.parse_args()

    cfg = di.ModelConfig.preset(args.preset)
    params = device_params(cfg)
    bw = hbm_bandwidth()
    print(f"device {jax.devices()[0].device_kind}; measured HBM bandwidth {bw / 1e12:.2f} TB/s")
    rows = []

    def save():
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"preset": args.preset, "device": jax.devices()[0].device_kind,
                       "jax": jax.__version__, "hbm_bandwidth_Bps": bw, "steps": args.steps,
                       "reps": args.reps, "results": rows}, f, indent=1)

    def measure(batch, context, force_xla):
        ctx = [kernels.use(op, "xla") for op in ("grouped_matmul", "attention", "sparse_attention")] if force_xla else []
        for c in ctx:
            c.__enter__()
        try:
            chosen = {op: kernels.choose(op) for op in ("grouped_matmul", "attention", "sparse_attention")}
            step_s, compile_s = bench_point(params, batch, context, args.steps, args.reps)
        finally:
            for c in reversed(ctx):
                c.__exit__(None, None, None)
        need = step_bytes(cfg, batch, context)
        roof = need["total"] / bw
        row = dict(batch=batch, context=context, kernels=chosen, step_ms=step_s * 1e3,
                   tokens_per_s=batch / step_s, bytes_per_step=need, roofline_ms=roof * 1e3,
                   achieved_over_roofline=roof / step_s, compile_s=compile_s)
        rows.append(row)
        save()
        print(f"B={batch:3d} ctx={context:6d} {'xla-only' if force_xla else 'registry':9s} "
              f"step {step_s * 1e3:8.3f} ms  {batch / step_s:9.1f} tok/s  "
              f"roofline {roof * 1e3:7.3f} ms  achieved/roofline {roof / step_s:6.3f}  "
              f"kernels {chosen}", flush=True)

    for context in [int(c) for c in args.contexts.split(",")]:
        for batch in [int(b) for b in args.batches.split(",")]:
            measure(batch, context, args.xla)
    for point in filter(None, args.compare_xla.split(",")):
        b, c = (int(v) for v in point.split(":"))
        measure(b, c, True)
    save()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
