"""GPU compile times without a GPU: XLA:GPU compiles the programs of `lean.py`'s compile
section (a one-token decode step at batch 16, context 4k, and a 1 x 512 prefill chunk) for an
H200 described by `benchmarks/targets/h200.txtpb`, on this machine's CPU. The HLO passes
(priority fusion, the pass that stalled) run as on the device; autotuning does not (there is no
device to time on), and kernels chosen by platform run as their XLA references (Mosaic GPU
kernels need the device), so the numbers measure XLA's own compile of the model. Measured
here against the H200: about 2-3x the device's seconds on a 2-core host.

Set-up (once; the CUDA PJRT plugin, no CUDA libraries needed):

    pip download --no-deps -d /tmp/cuda_whl jax-cuda13-plugin==0.11.2 jax-cuda13-pjrt==0.11.2
    mkdir -p /tmp/cuda_site && (cd /tmp/cuda_site && for w in /tmp/cuda_whl/*.whl; do unzip -qo $w; done)

Run:

    PYTHONPATH=.:/tmp/cuda_site JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 \\
        python benchmarks/compile_deviceless.py --models default,mini --out /tmp/deviceless.json
    ... --sinkhorn-iters 1          # the same models with a 1-iteration mHC Sinkhorn
    ... --mainjob                   # the README main job's programs, loop vs chunked prefill
    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=hlo_pass_pipeline=1 ...   # every pass with its time
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(ROOT, "benchmarks", "targets", "h200.txtpb")
SETUP_HINT = ("the CUDA PJRT plugin is not importable: see this script's docstring "
              "(jax-cuda13-plugin and jax-cuda13-pjrt on PYTHONPATH, "
              "JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1)")


def gpu_sharding(target_config: str):
    """A single-device NamedSharding on a deviceless CUDA topology of `target_config`."""
    import jax
    from jax.experimental import topologies
    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=target_config,
                                            topology="1x1x1")
    except (NotImplementedError, RuntimeError) as e:
        raise SystemExit(f"compile_deviceless: {SETUP_HINT} ({type(e).__name__}: {e})")
    mesh = topologies.make_mesh(topo, (1,), ("x",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def on(sharding, tree):
    """ShapeDtypeStructs of `tree`'s leaves placed with `sharding`."""
    import jax
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                        tree)


def fusions(hlo_text: str) -> int:
    """Fusion instructions of a compiled module (each one kernel)."""
    return len(re.findall(r"= [^=]*? fusion\(", hlo_text))


def compile_model(name: str, sharding, sinkhorn_iters: int | None, batch: int, context: int,
                  chunk: int) -> list[dict]:
    """Rows {model, program, lower_s, compile_s, fusions} of one model's two programs."""
    import jax
    import jax.numpy as jnp
    from benchmarks import hlo_count, lean
    dtype = jnp.bfloat16
    if name == "default":
        import deepinfer_fn as di
        params = jax.eval_shape(lambda: di.load_params(di.default_model_path(), dtype=dtype))
    else:
        params, _ = lean.model_for(name, dtype)
    cfg = params.config
    if sinkhorn_iters is not None:
        cfg = dataclasses.replace(cfg, hc_sinkhorn_iters=sinkhorn_iters)
        params = dataclasses.replace(params, config=cfg)
    _, token_map, _ = lean.token_map_for(cfg)
    ctx = min(context, cfg.max_position_embeddings)
    programs = {
        "decode": (lean.decode_step_fn(token_map),
                   (lean.abstract_state(cfg, batch, ctx, dtype),
                    jax.ShapeDtypeStruct((batch,), jnp.int32))),
        "prefill": (lean.prefill_fn(token_map),
                    (lean.abstract_state(cfg, 1, ctx, dtype),
                     jax.ShapeDtypeStruct((1, chunk), jnp.int32))),
    }
    rows = []
    for prog, (fn, rest) in programs.items():
        row = dict(model=name, program=prog, layers=cfg.num_hidden_layers,
                   sinkhorn_iters=cfg.hc_sinkhorn_iters,
                   batch=batch if prog == "decode" else 1,
                   tokens=1 if prog == "decode" else chunk, context=ctx)
        try:
            t0 = time.perf_counter()
            lowered = jax.jit(fn, donate_argnums=(1,)).lower(on(sharding, params),
                                                             *on(sharding, rest))
            t1 = time.perf_counter()
            compiled = lowered.compile()
            compile_s = time.perf_counter() - t1
            text = compiled.as_text()
            report = hlo_count.count_text(text)
            row.update(lower_s=t1 - t0, compile_s=compile_s, fusions=fusions(text),
                       kernels=report["kernels"], bytes_written=report["bytes_written"],
                       kernels_env=os.environ.get("DEEPINFER_KERNELS", ""))
        except Exception as e:  # noqa: BLE001  (one program failing must not lose the others)
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def mainjob_programs(sharding, new_tokens: int = 96) -> list[dict]:
    """Rows {model, program, prefill, lower_s, compile_s, fusions} of the programs `generate`
    compiles for the README main job (default model, one prompt), taken from
    `generate.generate_programs` itself: a 4-token prompt (the loop prefill: the decode loop
    feeds the prompt) and the same job with the loop prefill off (the chunked prefill)."""
    import importlib
    import jax
    import jax.numpy as jnp
    import deepinfer_fn as di
    generate = importlib.import_module("deepinfer_fn.generate")
    params = jax.eval_shape(lambda: di.load_params(di.default_model_path(),
                                                   dtype=jnp.bfloat16))
    place = lambda tree: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        if isinstance(x, jax.ShapeDtypeStruct) else x, tree)
    rows = []
    for mode in ("loop", "chunked"):
        before = os.environ.get("DEEPINFER_LOOP_PREFILL")
        os.environ["DEEPINFER_LOOP_PREFILL"] = "on" if mode == "loop" else "off"
        try:
            jobs = generate.generate_programs(params, 1, 4, new_tokens)
            for job in jobs:
                row = dict(model="default", program=getattr(job.fn, "__name__", str(job.fn)),
                           prefill=mode)
                args, kwargs = place(job.args), place(job.kwargs)
                jitted = job.fn.jit_for(*args, **kwargs) if hasattr(job.fn, "jit_for") else job.fn
                t0 = time.perf_counter()
                lowered = jitted.lower(*args, **kwargs)
                t1 = time.perf_counter()
                text = lowered.compile().as_text()
                row.update(lower_s=t1 - t0, compile_s=time.perf_counter() - t1,
                           fusions=fusions(text))
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            if before is None:
                os.environ.pop("DEEPINFER_LOOP_PREFILL")
            else:
                os.environ["DEEPINFER_LOOP_PREFILL"] = before
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="default", help="default, tiny, mini, v4-flash, ...")
    ap.add_argument("--sinkhorn-iters", type=int, default=None)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--target", default=TARGET, help="XLA GPU target config (text proto)")
    ap.add_argument("--mainjob", action="store_true",
                    help="the README main job's programs instead (generate_programs of the "
                         "default model: loop prefill vs chunked prefill)")
    ap.add_argument("--out", default=None, help="JSON file for the rows")
    args = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    os.environ.setdefault("DEEPINFER_COMPILE_CACHE", "off")
    with open(args.target) as f:
        sharding = gpu_sharding(f.read())
    import jax
    rows = mainjob_programs(sharding) if args.mainjob else []
    for name in filter(None, "" if args.mainjob else args.models.split(",")):
        rows += compile_model(name, sharding, args.sinkhorn_iters, args.batch, args.context,
                              args.chunk)
    if args.out:
        meta = {"what": "XLA:GPU compile for an H200 target on a host without a GPU "
                        "(benchmarks/compile_deviceless.py)", "jax": jax.__version__,
                "target": os.path.relpath(args.target, ROOT), "argv": sys.argv[1:]}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
