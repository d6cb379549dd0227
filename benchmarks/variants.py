"""Kernel choices against each other in one process: each variant's program (the decode loop
`lean.decode_loop_fn`, `--steps` steps a call, or one prefill chunk `lean.prefill_fn`)
lowered with its choices in force, all compiled in parallel threads, then timed in
alternating rounds on the same weights and state, with its kernel count (`hlo_count`) and
its output checked against the first variant's (decode: the first call's tokens; prefill:
logits, relative L2 and top-1 agreement).

    python benchmarks/variants.py decode --variants default,attention,mhc_split --out F.json
    python benchmarks/variants.py prefill --shapes 1x4096,8x512 \
        --variants default,query_folded,topk_select --out F.json
    python benchmarks/variants.py prefill --preset tiny --shapes 1x64 \
        --variants default,topk_select --out F.json                          # CPU

Variants (`VARIANTS`): registry overrides (`kernels.use`) and module switches read while
tracing; `a+b` puts several in force at once (`--variants default,attention+mhc_split`).
Without an sm_90 GPU the Mosaic variants are refused by their kernels.
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
import numpy as np  # noqa: E402

import deepinfer_fn as di  # noqa: E402
from benchmarks import hlo_count, lean  # noqa: E402
from deepinfer_fn import kernels  # noqa: E402

# name -> (registry overrides {op: impl}, switches [(module, attribute, value)])
VARIANTS = {
    "default": ({}, []),
    "attention": ({"attention": "mosaic_gpu"}, []),
    "mhc_one": ({}, [("custom_calls.mhc", "ONE_KERNEL_MIN_TOKENS", 1)]),     # narrow streams
    "mhc_split": ({}, [("custom_calls.mhc", "SPLIT_MIN_TOKENS", 1)]),        # wide streams
    "swiglu": ({"grouped_swiglu": "mosaic_gpu"}, []),
    "query_folded": ({}, [("custom_calls.chunk_attention", "PREPARE_QUERY_IN_KERNEL", False)]),
    "topk_sort": ({"top_k_mask": "xla"}, []),
    "topk_select": ({"top_k_mask": "xla_select"}, []),
    "rows_select": ({"top_k_rows": "xla_select"}, []),
    # prefill: selected rows as a mask over a buffer of up to 8192 rows (default 4096) instead
    # of gathered per token (V4.1's token-level rows pass 4096 at a 4k context)
    "dense_rows_8k": ({}, [("deepinfer_fn.model.cached", "DENSE_ROWS_MAX", 8192),
                           ("deepinfer_fn.model.cached_v41", "DENSE_ROWS_MAX", 8192)]),
}


def choices(name: str) -> tuple[dict, list]:
    """(registry overrides, module switches) of a variant or a `+`-joined combination."""
    overrides, switches = {}, []
    for part in name.split("+"):
        if part not in VARIANTS:
            raise ValueError(f"unknown variant {part!r}; known: {', '.join(VARIANTS)}")
        overrides.update(VARIANTS[part][0])
        switches += VARIANTS[part][1]
    return overrides, switches


@contextlib.contextmanager
def variant(name: str):
    """The variant's choices in force inside the block (restored after)."""
    overrides, switches = choices(name)
    with contextlib.ExitStack() as stack:
        for op, impl in overrides.items():
            stack.enter_context(kernels.use(op, impl))
        for module, attr, value in switches:
            mod = __import__(module, fromlist=[attr])
            stack.callback(setattr, mod, attr, getattr(mod, attr))
            setattr(mod, attr, value)
        yield


def lower_each(fn, names, *args) -> dict:
    """{name: jax.jit(fn) lowered on args with the variant in force} (a fresh jit each, and
    JAX's trace caches cleared: the choices are read while tracing, and an inner jitted
    function traced for one variant would otherwise be reused by the next)."""
    lowered = {}
    for name in names:
        jax.clear_caches()
        with variant(name):
            lowered[name] = fn().lower(*args)
    return lowered


def alternate(run, names, rounds: int, reps: int) -> dict:
    """{name: [seconds a call, one value a round]}: `run(name)` reps times a round, the
    variants' order reversed every other round."""
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            out = None
            for _ in range(reps):
                out = run(name)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t0) / reps)
    return times


def decode_points(cfg, params, token_map, names, batches, context: int, steps: int,
                  rounds: int, reps: int, emit):
    """The decode comparison: emit(row) for each (batch, variant) as soon as it is timed."""
    slack = (rounds * reps + 2) * steps + 8
    loop = lean.decode_loop_fn(steps, token_map)
    jobs = []
    for b in batches:
        state = jax.eval_shape(lambda: lean.filled_state(cfg, b, context, jnp.bfloat16,
                                                         slack=slack))
        token = jax.ShapeDtypeStruct((b,), jnp.int32)
        lowered = lower_each(lambda: jax.jit(loop, donate_argnums=(1,)), names, params,
                             state, token)
        jobs += [((b, n), lw) for n, lw in lowered.items()]
    futures = lean.compile_in_threads(jobs, lean.compile_threads())
    for b in batches:
        compiled = {n: futures[(b, n)].result() for n in names}
        carry, first = {}, {}
        for n in names:       # each variant on its own filled state (same seed); warm-up call
            st = lean.filled_state(cfg, b, context, jnp.bfloat16, slack=slack)
            carry[n] = compiled[n][0](params, st, jnp.zeros((b,), jnp.int32))
            first[n] = np.asarray(carry[n][1]).tolist()

        def run(n):
            carry[n] = compiled[n][0](params, *carry[n])
            return carry[n][1]
        times = alternate(run, names, rounds, reps)
        for n in names:
            step_ms = [t / steps * 1e3 for t in times[n]]
            emit(dict(program="decode", batch=b, context=context, variant=n,
                             step_ms=step_ms, median_ms=float(np.median(step_ms)),
                             kernels_per_step=hlo_count.count_text(
                                 compiled[n][0].as_text())["kernels"] / steps,
                             compile_s=compiled[n][1],
                             same_tokens_as_first=first[n] == first[names[0]]))


def prefill_points(cfg, params, token_map, names, shapes, rounds: int, reps: int, emit):
    """The prefill comparison: emit(row) for each (shape, variant) as soon as it is timed."""
    jobs, inputs = [], {}
    for shape in shapes:
        batch, tokens = (int(v) for v in shape.split("x"))
        state = di.init_state(cfg, batch, tokens + 256, dtype=jnp.bfloat16)
        ids = jax.random.randint(jax.random.key(2), (batch, tokens), 0, cfg.vocab_size,
                                 jnp.int32)
        inputs[shape] = (state, ids)
        lowered = lower_each(lambda: jax.jit(lean.prefill_fn(token_map)), names, params,
                             state, ids)
        jobs += [((shape, n), lw) for n, lw in lowered.items()]
    futures = lean.compile_in_threads(jobs, lean.compile_threads())
    for shape in shapes:
        state, ids = inputs[shape]
        compiled = {n: futures[(shape, n)].result() for n in names}
        logits = {n: np.asarray(compiled[n][0](params, state, ids)[0], np.float64)
                  for n in names}
        times = alternate(lambda n: compiled[n][0](params, state, ids), names, rounds, reps)
        ref = logits[names[0]]
        for n in names:
            ms = [t * 1e3 for t in times[n]]
            emit(dict(program="prefill", shape=shape, variant=n, ms=ms,
                             median_ms=float(np.median(ms)),
                             kernels=hlo_count.count_text(compiled[n][0].as_text())["kernels"],
                             compile_s=compiled[n][1],
                             logits_rel_diff=float(np.linalg.norm(logits[n] - ref)
                                                   / max(np.linalg.norm(ref), 1e-30)),
                             top1_agreement=float(np.mean(logits[n].argmax(-1)
                                                          == ref.argmax(-1)))))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("program", choices=("decode", "prefill"))
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--variants", default="default")
    ap.add_argument("--batches", default="1,64", help="decode batches")
    ap.add_argument("--context", type=int, default=4096, help="decode context")
    ap.add_argument("--steps", type=int, default=16, help="decode steps a call")
    ap.add_argument("--shapes", default="1x4096,8x512", help="BxS prefill chunks")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=3, help="calls a round")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    names = args.variants.split(",")
    try:
        chosen = {name: choices(name) for name in names}
    except ValueError as e:
        ap.error(str(e))
    cfg = di.ModelConfig.preset(args.preset)
    result = dict(command=" ".join(["benchmarks/variants.py"] + (argv or sys.argv[1:])),
                  preset=args.preset, device=jax.devices()[0].device_kind, jax=jax.__version__,
                  rounds=args.rounds, reps=args.reps,
                  variants={n: dict(overrides=o, switches=[list(s) for s in w])
                            for n, (o, w) in chosen.items()},
                  results=[])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def emit(row):          # printed and saved row by row: a run cut short keeps its rows
        result["results"].append(row)
        where = f"B={row['batch']}" if row["program"] == "decode" else row["shape"]
        print(f"{row['program']} {where} {row['variant']:13s} {row['median_ms']:8.3f} ms "
              f"(min {min(row.get('step_ms') or row['ms']):.3f})  "
              f"kernels {row.get('kernels_per_step', row.get('kernels'))}", flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    params = jax.block_until_ready(lean.random_weights(cfg, jnp.bfloat16))
    token_map = lean.token_map_for(cfg)[1]
    if args.program == "decode":
        decode_points(cfg, params, token_map, names, [int(b) for b in args.batches.split(",")],
                      args.context, args.steps, args.rounds, args.reps, emit)
    else:
        prefill_points(cfg, params, token_map, names, args.shapes.split(","), args.rounds,
                       args.reps, emit)
    return result


if __name__ == "__main__":
    main()
