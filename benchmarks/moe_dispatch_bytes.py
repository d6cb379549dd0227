"""Bytes an expert-parallel MoE layer moves per device per step: the fixed-capacity all-to-all
vs the ragged all-to-all (`shardings.moe`), for uniform and skewed routings.

Counted from routings (`shardings.moe.dispatch_bytes`): the fixed path sends ep * n*k rows
per device each way whatever the routing; the ragged path sends the n*k rows that exist plus
the int32 counts / offsets. "recv max" is the busiest device's rows under the ragged path (the
hot spot a skewed routing creates; the fixed path receives ep * n*k always).

`--measure` also runs one expert-parallel MoE layer on this host's devices (dp=1, ep = all of
them) with each dispatch, checks it against the single-device layer and times it: "ragged"
where the platform has it, else "ragged_emulated" (a CPU smoke test of the same arithmetic).

    python benchmarks/moe_dispatch_bytes.py --preset v4-flash --layouts "dp=1,ep=8;dp=1,ep=64" \
        --tokens 64,1024 --out benchmarks/results/moe_dispatch_bytes.json
    python benchmarks/moe_dispatch_bytes.py --preset mini --measure --tokens 64,1024 \
        --out benchmarks/results/moe_dispatch_h200x8.json          # on a multi-GPU host
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import time

import numpy as np

from deepinfer_fn.config import ModelConfig
from shardings.moe import dispatch_bytes, dispatch_rows


def gumbel_top_k(log_p, n_tokens: int, k: int, rng) -> np.ndarray:
    """k distinct experts per token drawn without replacement from softmax(log_p): [n, k]."""
    scores = log_p[None, :] + rng.gumbel(size=(n_tokens, log_p.size)).astype(np.float32)
    return np.argpartition(-scores, k - 1, axis=1)[:, :k].astype(np.int32)


def routing(name: str, n_tokens: int, n_experts: int, k: int, rng) -> np.ndarray:
    """"uniform"; "zipf" (expert popularity 1/rank, experts in random order); "hot_k" (every
    token to experts 0..k-1, all on device 0 while E/ep >= k)."""
    if name == "uniform":
        return gumbel_top_k(np.zeros(n_experts, np.float32), n_tokens, k, rng)
    if name == "zipf":
        log_p = -np.log(rng.permutation(n_experts) + 1.0).astype(np.float32)
        return gumbel_top_k(log_p, n_tokens, k, rng)
    if name == "hot_k":
        return np.tile(np.arange(k, dtype=np.int32), (n_tokens, 1))
    raise ValueError(f"unknown routing {name!r}")


def measure(cfg: ModelConfig, n: int, name: str, rng, reps: int = 10) -> list[dict]:
    """One MoE layer on all local devices per dispatch: median seconds and the error against
    the single-device layer (max |diff| / max |ref|), bf16 weights and activations."""
    import jax
    import jax.numpy as jnp

    import shardings
    from deepinfer_fn.model.experts import routed_experts
    from shardings import moe

    E, k, D, I = (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                  cfg.moe_intermediate_size)
    ep = jax.device_count()
    mesh = shardings.make_mesh(ep=ep)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)
    p = {name_: bf(rng.standard_normal(shape, np.float32) * 0.02)
         for name_, shape in [("w1", (E, D, I)), ("w3", (E, D, I)), ("w2", (E, I, D))]}
    x = bf(rng.standard_normal((n * ep, D), np.float32))
    idx = jnp.asarray(routing(name, n * ep, E, k, rng))
    weights = jnp.asarray(rng.random((n * ep, k), np.float32))
    want = np.asarray(jax.jit(lambda *a: routed_experts(*a, cfg.swiglu_limit))(p, x, idx, weights),
                      np.float32)
    from jax.sharding import NamedSharding, PartitionSpec as P
    p_ep = {key: jax.device_put(v, NamedSharding(mesh, P("ep"))) for key, v in p.items()}
    rows = jax.device_put((x, idx, weights), NamedSharding(mesh, P(("dp", "ep"))))
    ragged = "ragged" if moe.mesh_platform(mesh).lower() in moe.RAGGED_PLATFORMS else "ragged_emulated"
    out = []
    for dispatch in ("fixed", ragged):
        fn = jax.jit(lambda p_, x_, i_, w_: moe.ep_routed_experts(
            p_, x_, i_, w_, cfg.swiglu_limit, mesh, dispatch=dispatch))
        got = np.asarray(fn(p_ep, *rows), np.float32)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(p_ep, *rows))
            times.append(time.perf_counter() - t0)
        out.append({"dispatch": dispatch, "ep": ep, "tokens_per_device": n, "routing": name,
                    "platform": moe.mesh_platform(mesh), "seconds_median": float(np.median(times)),
                    "rel_err_vs_single_device": float(np.abs(got - want).max()
                                                      / max(np.abs(want).max(), 1e-30))})
        print(f"measured {dispatch:>16} ep={ep} n={n} {name:>8}: "
              f"{out[-1]['seconds_median'] * 1e3:.3f} ms, rel err {out[-1]['rel_err_vs_single_device']:.2e}")
    return out


def parse_layouts(text: str) -> list[dict[str, int]]:
    out = []
    for part in text.split(";"):
        kv = dict(item.split("=") for item in part.split(","))
        out.append({"dp": int(kv.get("dp", 1)), "ep": int(kv["ep"])})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="v4-flash")
    ap.add_argument("--layouts", default="dp=1,ep=8;dp=8,ep=8;dp=1,ep=64")
    ap.add_argument("--tokens", default="64,1024", help="tokens per device per step")
    ap.add_argument("--routings", default="uniform,zipf,hot_k")
    ap.add_argument("--itemsize", type=int, default=2, help="bytes per activation (bf16: 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--measure", action="store_true",
                    help="also run and time one MoE layer per dispatch on this host's devices")
    ap.add_argument("--tolerance", type=float, default=2e-2,
                    help="--measure fails (exit 1) above this error vs the single-device layer")
    ap.add_argument("--out", default="benchmarks/results/moe_dispatch_bytes.json")
    args = ap.parse_args()
    cfg = ModelConfig.preset(args.preset)
    E, k, D, layers = (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                       cfg.num_hidden_layers)
    rng = np.random.default_rng(args.seed)
    rows_out = []
    print(f"{args.preset}: E={E} k={k} D={D}, {layers} MoE layers, {args.itemsize}-byte "
          f"activations; MB per device per step (dispatch + combine, all MoE layers)")
    print(f"{'layout':>12} {'tok/dev':>8} {'routing':>11} {'fixed':>10} {'ragged':>10} "
          f"{'ratio':>6} {'fixed rem':>10} {'ragged rem':>10} {'recv max':>9} {'fixed rows':>10}")
    for layout in parse_layouts(args.layouts):
        dp, ep = layout["dp"], layout["ep"]
        for n in (int(t) for t in args.tokens.split(",")):
            for name in args.routings.split(","):
                idx = routing(name, n * dp * ep, E, k, rng)
                rows = dispatch_rows(idx, E, dp, ep)
                by = dispatch_bytes(idx, E, dp, ep, hidden=D, itemsize=args.itemsize)
                rec = {"preset": args.preset, "dp": dp, "ep": ep, "tokens_per_device": n,
                       "routing": name, "moe_layers": layers,
                       **{f"{key}_bytes_per_step": int(v.max()) * layers for key, v in by.items()},
                       "ragged_received_rows_max": int(rows["ragged_received"].max()),
                       "fixed_received_rows": int(rows["fixed"][0])}
                rows_out.append(rec)
                mb = lambda key: rec[f"{key}_bytes_per_step"] / 1e6
                print(f"{f'dp={dp},ep={ep}':>12} {n:>8} {name:>11} {mb('fixed'):>10.1f} "
                      f"{mb('ragged'):>10.1f} {mb('fixed') / mb('ragged'):>6.1f} "
                      f"{mb('fixed_remote'):>10.1f} {mb('ragged_remote'):>10.1f} "
                      f"{rec['ragged_received_rows_max']:>9} {rec['fixed_received_rows']:>10}")
    measured = []
    if args.measure:
        for n in (int(t) for t in args.tokens.split(",")):
            for name in args.routings.split(","):
                measured += measure(cfg, n, name, rng)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"note": "bytes each device sends per step (max over devices), counted "
                               "from routings by shardings.moe.dispatch_bytes; not timed",
                       "rows": rows_out, "measured": measured}, f, indent=1)
        print(f"wrote {args.out}")
    bad = [m for m in measured if not m["rel_err_vs_single_device"] <= args.tolerance]
    if bad:
        print(f"FAIL: {len(bad)} measured runs differ from the single-device layer by more than "
              f"{args.tolerance}: {[(m['dispatch'], m['routing'], m['tokens_per_device']) for m in bad]}")
        sys.exit(1)


if __name__ == "__main__":
    main()
