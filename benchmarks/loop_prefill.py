"""Short prompts: the loop prefill (generate's decode loop feeds the prompt) against the chunked
prefill program (DEEPINFER_LOOP_PREFILL=off), in one process, same weights and shapes.

Per model, batch and arm: the seconds `generate`'s first call spends obtaining its programs
(compile, with the persistent cache off so nothing is reused across arms) and their names,
then the warm wall time of the same call (median of --reps, tokens fetched to the host).

    python benchmarks/loop_prefill.py --out benchmarks/results/loop_prefill_<gpu>.json
    python benchmarks/loop_prefill.py --models tiny --batches 1 --new-tokens 4 --reps 1  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = ("loop", "chunked")


def model_params(name: str, dtype: str = "bfloat16"):
    """Concrete params of 'default' (the embedded checkpoint), 'tiny' or 'mini' (random)."""
    import jax.numpy as jnp
    from benchmarks import lean
    import deepinfer_fn as di
    dtype = jnp.dtype(dtype)
    if name == "default":
        return di.load_params(di.default_model_path(), dtype=dtype)
    return lean.random_weights(di.ModelConfig.preset(name), dtype)


def measure(params, batch: int, prompt_len: int, new_tokens: int, arm: str, reps: int) -> dict:
    """One arm: first call (programs, their seconds) and warm wall seconds of `generate`."""
    import jax
    import numpy as np
    import deepinfer_fn as di
    from deepinfer_fn.compile_cache import ProgramCounter
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; choose from {ARMS}")
    jax.clear_caches()
    rng = np.random.default_rng(0)
    tokens = rng.integers(2, params.config.vocab_size, (batch, prompt_len)).astype(np.int32)
    run = lambda: di.generate(params, tokens, max_new_tokens=new_tokens, temperature=0.7,
                              seed=1)
    before = os.environ.get("DEEPINFER_LOOP_PREFILL")
    os.environ["DEEPINFER_LOOP_PREFILL"] = "on" if arm == "loop" else "off"
    try:
        t0 = time.perf_counter()
        with ProgramCounter() as counter:
            first = run()
        first_s = time.perf_counter() - t0
        walls = []
        for _ in range(reps):
            t0 = time.perf_counter()
            out = run()
            walls.append(time.perf_counter() - t0)
    finally:
        if before is None:
            os.environ.pop("DEEPINFER_LOOP_PREFILL")
        else:
            os.environ["DEEPINFER_LOOP_PREFILL"] = before
    return dict(arm=arm, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
                first_call_s=first_s, programs=list(counter.names),
                program_seconds=counter.seconds, warm_s=statistics.median(walls),
                warm_all_s=walls, tokens=np.asarray(out.tokens)[:, :8].tolist(),
                same_tokens_as_first=bool((np.asarray(out.tokens) == np.asarray(first.tokens))
                                          .all()))


def line(model: str, row: dict) -> str:
    return (f"{model:8s} B={row['batch']:3d} {row['arm']:8s} "
            f"first call {row['first_call_s']:6.1f} s"
            f" (programs {row['program_seconds']:5.1f} s: {', '.join(row['programs'])})"
            f"  warm {row['warm_s'] * 1e3:8.1f} ms")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="default,mini")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("DEEPINFER_COMPILE_CACHE", "off")
    sys.path.insert(0, ROOT)
    import jax
    rows = {}
    for model in args.models.split(","):
        params = model_params(model, args.dtype)
        rows[model] = []
        for batch in (int(b) for b in args.batches.split(",")):
            for arm in ARMS:
                row = measure(params, batch, args.prompt_len, args.new_tokens, arm, args.reps)
                rows[model].append(row)
                print(line(model, row), flush=True)
    result = dict(command="python benchmarks/loop_prefill.py " + " ".join(argv or sys.argv[1:]),
                  device=str(jax.devices()[0].device_kind), rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print("wrote", args.out)
    return result


if __name__ == "__main__":
    main()
