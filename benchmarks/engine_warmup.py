"""Seconds `Engine.warmup()` takes in this process, plain and DSpark, on the default model.

Run it twice with the same cache directory: the second process loads every sub-step program
whole from the program cache (`deepinfer_fn/program_cache.py`) instead of tracing, lowering
and compiling it. Prints one JSON line (warm-up seconds, programs, disk loads, the tokens of
one request, so two runs can be compared).

    DEEPINFER_COMPILE_CACHE=/tmp/c python benchmarks/engine_warmup.py   # twice
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--arms", default="plain,dspark")
    args = ap.parse_args()
    t0 = time.perf_counter()
    import jax.numpy as jnp
    import deepinfer_fn as di
    from deepinfer_fn import program_cache
    model = di.load_model(dtype=getattr(jnp, args.dtype))
    out = {}
    for arm in args.arms.split(","):
        kw = dict(speculative="dspark") if arm == "dspark" else {}
        eng = di.Engine(model, max_batch=args.max_batch, progress=False, **kw)
        t = time.perf_counter()
        with di.ProgramCounter() as c:
            eng.warmup()
        out[arm] = dict(warmup_s=round(time.perf_counter() - t, 2), programs=c.programs,
                        disk_hits=c.disk_hits)
        r = eng.generate([di.Request(list(range(5, 40)), max_new_tokens=16, request_id=0)])
        out[arm]["tokens"] = [int(t) for t in r[0].tokens]
    out["loaded"], out["compiled"] = program_cache.stats.loaded, program_cache.stats.compiled
    out["process_s"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
