"""Where a program's lowering time goes: seconds per Mosaic GPU kernel lowered, and the share of
Mosaic GPU's layout inference, for the decode step (or a prefill chunk) of the embedded default
model or a preset (abstract weights), persistent cache off.

    python benchmarks/lowering_profile.py                              # on a GPU
    python benchmarks/lowering_profile.py --model mini --program prefill --tokens 512
    DEEPINFER_KERNELS=mhc_pre=mosaic_gpu,... PYTHONPATH=.:/tmp/cuda_site \\
        JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python benchmarks/lowering_profile.py --deviceless

--deviceless lowers for the H200 target on a host without a GPU (set-up: compile_deviceless.py);
there the registry's platform preference is the CPU's, so force the GPU's kernel choice with
DEEPINFER_KERNELS, and a kernel whose call sites see different abstract meshes may lower twice.
Each kernel is timed by wrapping JAX's Pallas Mosaic GPU `lower_jaxpr_to_module` (an internal
function of this JAX version: the probe says so when it is missing).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def time_kernel_lowerings(records: list) -> bool:
    """Wraps Pallas Mosaic GPU's per-kernel lowering to append (seconds, grid, input avals) to
    records. False where this JAX has no such function."""
    import importlib
    try:
        lowering = importlib.import_module("jax._src.pallas.mosaic_gpu.lowering")
    except ImportError:
        return False
    inner = getattr(lowering, "lower_jaxpr_to_module", None)
    if inner is None:
        return False

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        grid = args[2] if len(args) > 2 else kwargs.get("grid")
        avals = args[5] if len(args) > 5 else kwargs.get("in_shapes", ())
        records.append(dict(seconds=round(time.perf_counter() - t0, 3), grid=list(grid or ()),
                            inputs=[str(a) for a in avals]))
        return out
    lowering.lower_jaxpr_to_module = timed
    return True


def profile_seconds(stats: pstats.Stats, suffix: str) -> float:
    """Cumulative seconds of the profiled functions whose file:name ends with suffix."""
    return sum(v[3] for (f, _, name), v in stats.stats.items() if f"{f}:{name}".endswith(suffix))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="default (embedded) or a preset name")
    ap.add_argument("--program", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--batch", type=int, default=16, help="decode rows")
    ap.add_argument("--tokens", type=int, default=512, help="prefill chunk width")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--deviceless", action="store_true", help="H200 target, no GPU needed")
    ap.add_argument("--out", default=None, help="JSON file")
    args = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    os.environ.setdefault("DEEPINFER_COMPILE_CACHE", "off")
    import jax
    import jax.numpy as jnp
    from benchmarks import compile_deviceless, lean
    records: list = []
    timed = time_kernel_lowerings(records)
    place = lambda tree: tree
    if args.deviceless:
        with open(compile_deviceless.TARGET) as f:
            sharding = compile_deviceless.gpu_sharding(f.read())
        place = lambda tree: compile_deviceless.on(sharding, tree)
    if args.model == "default":
        import deepinfer_fn as di
        params = jax.eval_shape(lambda: di.load_params(di.default_model_path(),
                                                       dtype=jnp.bfloat16))
    else:
        params, _ = lean.model_for(args.model, jnp.bfloat16)
    cfg = params.config
    _, token_map, _ = lean.token_map_for(cfg)
    ctx = min(args.context, cfg.max_position_embeddings)
    if args.program == "decode":
        fn = lean.decode_step_fn(token_map)
        rest = (lean.abstract_state(cfg, args.batch, ctx, jnp.bfloat16),
                jax.ShapeDtypeStruct((args.batch,), jnp.int32))
    else:
        fn = lean.prefill_fn(token_map)
        rest = (lean.abstract_state(cfg, 1, ctx, jnp.bfloat16),
                jax.ShapeDtypeStruct((1, args.tokens), jnp.int32))
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    jax.jit(fn, donate_argnums=(1,)).lower(place(params), *place(rest))
    profiler.disable()
    lower_s = time.perf_counter() - t0
    stats = pstats.Stats(profiler)
    row = dict(model=args.model, program=args.program, device=str(jax.devices()[0].device_kind),
               deviceless=args.deviceless, kernels_env=os.environ.get("DEEPINFER_KERNELS", ""),
               lower_s_profiled=round(lower_s, 2),
               layout_inference_s=round(
                   profile_seconds(stats, "layout_inference.py:infer_layout"), 2),
               kernel_lowering_timed=timed, kernels_lowered=len(records),
               kernel_lowering_s=round(sum(r["seconds"] for r in records), 2),
               kernels=sorted(records, key=lambda r: -r["seconds"]))
    print(json.dumps({k: v for k, v in row.items() if k != "kernels"}))
    for r in row["kernels"]:
        print(f"  {r['seconds']:7.2f} s  grid {r['grid']}  {', '.join(r['inputs'][:4])}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
