"""MoE layer time on one device: sorted dispatch + grouped GEMM + combine (the registry's
kernels, and XLA's ragged_dot for comparison) against the dense reference that runs every
expert on every token and masks with the routing weights. `mini` preset shapes.

    python benchmarks/moe.py --out benchmarks/results/moe.json
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
import numpy as np

import deepinfer_fn as di
from deepinfer_fn import kernels
from deepinfer_fn.model.common import einsum
from deepinfer_fn.model.moe import routed_experts, swiglu


def dense_reference(p, x, idx, weights, limit):
    """Every token through every expert, then the routing weights as a dense [N,E] mask."""
    n_exp = p["w1"].shape[0]
    gate = einsum("nd,edi->nei", x, p["w1"], out_dtype=x.dtype)
    up = einsum("nd,edi->nei", x, p["w3"], out_dtype=x.dtype)
    y = einsum("nei,eid->ned", swiglu(gate, up, limit), p["w2"], out_dtype=jnp.float32)
    dense_w = jnp.zeros((x.shape[0], n_exp), jnp.float32).at[
        jnp.arange(x.shape[0])[:, None], idx].add(weights)
    return jnp.einsum("ne,ned->nd", dense_w, y).astype(x.dtype)


def timeit(fn, *args, reps=20):
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--tokens", default="1,16,64,4096")
    ap.add_argument("--out", default="benchmarks/results/moe.json")
    args = ap.parse_args()
    cfg = di.ModelConfig.preset(args.preset)
    E, D, I, k = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    key = jax.random.key(0)
    ks = jax.random.split(key, 6)
    dt = jnp.bfloat16
    p = {"w1": (jax.random.normal(ks[0], (E, D, I)) / D ** 0.5).astype(dt),
         "w3": (jax.random.normal(ks[1], (E, D, I)) / D ** 0.5).astype(dt),
         "w2": (jax.random.normal(ks[2], (E, I, D)) / I ** 0.5).astype(dt)}
    rows = []
    for n in [int(t) for t in args.tokens.split(",")]:
        x = jax.random.normal(ks[3], (n, D)).astype(dt)
        idx = jnp.argsort(jax.random.uniform(ks[4], (n, E)), axis=-1)[:, :k].astype(jnp.int32)
        w = jax.random.uniform(ks[5], (n, k))
        routed = jax.jit(lambda p, x, i, w: routed_experts(p, x, i, w, cfg.swiglu_limit))
        dense = jax.jit(lambda p, x, i, w: dense_reference(p, x, i, w, cfg.swiglu_limit))
        impl = kernels.choose("grouped_matmul")
        t_reg = timeit(routed, p, x, idx, w)
        with kernels.use("grouped_matmul", "xla"), kernels.use("grouped_swiglu", "xla"):
            routed_xla = jax.jit(lambda p, x, i, w: routed_experts(p, x, i, w, cfg.swiglu_limit))
            t_xla = timeit(routed_xla, p, x, idx, w)
        t_dense = timeit(dense, p, x, idx, w)
        a = np.asarray(routed(p, x, idx, w), np.float32)
        b = np.asarray(dense(p, x, idx, w), np.float32)
        err = float(np.abs(a - b).max() / (np.abs(b).max() + 1e-9))
        row = dict(tokens=n, grouped_impl=impl, dispatch_grouped_combine_ms=t_reg * 1e3,
                   same_with_xla_ragged_dot_ms=t_xla * 1e3, dense_reference_ms=t_dense * 1e3,
                   speedup_vs_dense=t_dense / t_reg, speedup_vs_xla_ragged=t_xla / t_reg,
                   rel_err_vs_dense=err)
        rows.append(row)
        print(f"tokens {n:5d}: {impl} {t_reg * 1e3:8.3f} ms | xla ragged_dot {t_xla * 1e3:8.3f} ms | "
              f"dense {t_dense * 1e3:8.3f} ms | x{t_dense / t_reg:6.1f} vs dense, "
              f"x{t_xla / t_reg:5.1f} vs ragged_dot | rel err {err:.1e}", flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"preset": args.preset, "device": jax.devices()[0].device_kind,
                   "experts": E, "hidden": D, "intermediate": I, "top_k": k, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
