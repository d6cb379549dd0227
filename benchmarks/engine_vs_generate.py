"""The offline engine against `generate`'s device-side decode loop on the same work.

Work per concurrency N: 4 N requests of --prompt-len tokens, --new greedy tokens each, no stop
token. `generate` runs them as 4 batches of N rows (one call each: prefill + its decode loop);
the engine runs them all with max_batch = N (prefill sub-batches of 1, 4, 16 or N rows, decode
bucket N, prefix cache off), so both do the same prefills and decode steps. Compilation is excluded
(`generate` is called once before timing, `Engine.warmup()` compiles every shape). Arms:

  plain    generate vs Engine(decode_steps=K) and Engine(decode_steps=1) (one step per call);
           `--engine-steps 8d,8f,1`: "Kf" / "Kd" add decode_loop="fixed" / "dynamic"; a
           trailing "s" ("8fs") compiles the single prefill shape (N, prompt) instead of the
           ladder; then "a" + B ("8fa4") sets the engine's admit_batch to B
  dspark   the same with the model bundle's DSpark drafter (verify_len "fixed"); on `mini`
           a random drafter (no trained one exists): tokens per step near 1, so the ratio
           compares step costs

Per engine arm: generated tok/s and its ratio to generate's, decode steps per device call,
and device idle between steps as a fraction of device time (a second run with
Engine(measure_idle=True)); also the share of requests whose tokens equal generate's (bf16
numerics depend on batch composition, so this is reported, not asserted).

    python benchmarks/engine_vs_generate.py --model default --concurrency 16,60 \
        --arms plain,dspark --out benchmarks/results/engine_vs_generate_default_h200.json
    python benchmarks/engine_vs_generate.py --model mini --concurrency 16,60 --arms plain \
        --out benchmarks/results/engine_vs_generate_mini_h200.json
    python benchmarks/engine_vs_generate.py --quick          # CPU smoke run
    bash benchmarks/engine_table.sh DIR      # GPU: one process per (N, arm), compiled in parallel
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import jax.numpy as jnp
import numpy as np

import deepinfer_fn as di
from deepinfer_fn.engine import Engine, Request


def load(model: str, dtype):
    """(params, drafter) of the embedded default model (its trained DSpark drafter) or the
    random `mini` preset with a random DSpark drafter (acceptance near 0: its dspark arm
    compares the cost of a verify step in the engine and in `generate`)."""
    if model == "default":
        bundle = di.load_model(dtype=dtype)
        return bundle.params, bundle.drafter
    from decode import device_params
    from deepinfer_fn.speculative.dspark import DSparkConfig, init_dspark
    cfg = di.ModelConfig.preset("mini")
    return (device_params(cfg, dtype),
            init_dspark(cfg, DSparkConfig.for_target(cfg), jax.random.key(1), dtype))


def prompts(model: str, n: int, length: int, vocab: int) -> np.ndarray:
    """int32 [n, length]: standard-library text for the default model, random ids for mini."""
    if model == "default":
        from speculative import make_prompts
        return make_prompts(n, length)
    return np.random.default_rng(0).integers(2, vocab, (n, length)).astype(np.int32)


def generate_arm(params, rows, N, new, spec_kw):
    """A timed callable running `generate` over the rows in batches of N (compiled here)."""
    batches = [rows[i:i + N] for i in range(0, len(rows), N)]
    call = lambda b: np.asarray(di.generate(params, b, max_new_tokens=new, **spec_kw).tokens)
    call(batches[0])                                   # compile
    return lambda: np.concatenate([call(b) for b in batches])


def parse_steps(steps: str) -> tuple[int, str | None, bool, int | None]:
    """"8fsa4" -> (decode_steps 8, decode_loop "fixed", single prefill shape True,
    admit_batch 4); each suffix optional."""
    m = re.fullmatch(r"(\d+)([fd]?)(s?)(?:a(\d+))?", steps)
    if not m:
        raise SystemExit(f"--engine-steps item {steps!r}: want K, Kf or Kd, optionally + 's', "
                         "then optionally 'a' + admit_batch")
    return (int(m[1]), {"f": "fixed", "d": "dynamic"}.get(m[2]), bool(m[3]),
            int(m[4]) if m[4] else None)


def engine_for(params, rows, N, new, steps: str, spec_kw):
    """An Engine for the work (every shape compiled, host caches warm). steps: `parse_steps`.
    Prefill shapes: a ladder of 1, 4, 16 and N rows of the prompt width, so a request admitted
    alone into a freed slot (speculative rows finish one by one) does not pay an N-row prefill;
    or (N, prompt) only."""
    P = rows.shape[1]
    K, loop, single, admit = parse_steps(steps)
    shapes = ((N, P),) if single else tuple((r, P) for r in sorted({1, 4, 16, N}) if r <= N)
    eng = Engine(params, max_batch=N, max_tokens_per_step=N * P + N, prefill_shapes=shapes,
                 decode_buckets=(N,), prefix_cache=False, max_len=P + new, progress=False,
                 decode_steps=K, decode_loop=loop, admit_batch=admit, **spec_kw)
    eng.warmup()
    eng.generate(requests(rows[:N], new))
    return eng


def requests(rows, new):
    return [Request(r.tolist(), max_new_tokens=new, request_id=i) for i, r in enumerate(rows)]


def timed(fn, repeats):
    """(median wall seconds, the last result)."""
    walls, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        walls.append(time.perf_counter() - t0)
    return float(np.median(walls)), out


def wait_for(paths, timeout_s=3600.0):
    t0 = time.time()
    while not all(os.path.exists(p) for p in paths):
        if time.time() - t0 > timeout_s:
            raise TimeoutError(f"waited {timeout_s} s for {paths}")
        time.sleep(0.2)


def touch(path):
    if path:
        with open(path, "w"):
            pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("default", "mini"), default="default")
    ap.add_argument("--concurrency", default="16,60")
    ap.add_argument("--arms", default="plain,dspark")
    ap.add_argument("--requests-per-slot", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: N = 4, 8 new tokens")
    ap.add_argument("--engine-steps", default=None,
                    help="comma list of decode_steps engines, 'Kf' / 'Kd' with decode_loop "
                         "'fixed' / 'dynamic', 's' a single prefill shape, 'aB' admit_batch B "
                         "(default: K,1; dspark leaves 1 out)")
    ap.add_argument("--compiled-file", default=None, help="touched once everything compiled")
    ap.add_argument("--wait-for", nargs="*", default=[], help="files to wait for before timing")
    ap.add_argument("--done-file", default=None, help="touched after timing")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.engine_steps = tuple(dict.fromkeys(
        x.strip() for x in (args.engine_steps or f"{args.decode_steps},1").split(",")))
    if args.quick:
        args.concurrency, args.new, args.repeats, args.prompt_len = "4", 8, 1, 32
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    params, drafter = load(args.model, getattr(jnp, args.dtype))
    arms = args.arms.split(",")
    if "dspark" in arms and drafter is None:
        print(f"NOTE: no DSpark drafter for --model {args.model}: dspark arm skipped")
        arms = [a for a in arms if a != "dspark"]
    device = jax.devices()[0].device_kind
    out = dict(device=device, host=platform.node(), model=args.model, dtype=args.dtype,
               prompt_len=args.prompt_len, new=args.new, decode_steps=args.decode_steps,
               repeats=args.repeats, results=[])
    print(f"{device}: model {args.model} ({args.dtype}), prompts {args.prompt_len}, "
          f"{args.new} new tokens, decode_steps {args.decode_steps}", flush=True)
    barriers = bool(args.compiled_file or args.wait_for)

    def setups():
        """(N, arm, rows, generate callable, engine factories), compiled lazily per item."""
        for N in (int(x) for x in args.concurrency.split(",")):
            rows = prompts(args.model, args.requests_per_slot * N, args.prompt_len,
                           params.config.vocab_size)
            for arm in arms:
                spec_kw = dict(speculative="dspark", drafter=drafter) if arm == "dspark" else {}
                steps = args.engine_steps
                if arm == "dspark":     # its one-step-per-call engine is left out
                    steps = tuple(k for k in steps if parse_steps(k)[0] != 1)
                yield N, arm, rows, spec_kw, steps

    def compiled(item):
        N, arm, rows, spec_kw, steps = item
        t0 = time.perf_counter()
        gen = generate_arm(params, rows, N, args.new, spec_kw)
        print(f"N={N:3d} {arm:6s} generate compiled in {time.perf_counter() - t0:.1f} s",
              flush=True)
        engines = {}
        for k in steps:
            t1 = time.perf_counter()
            engines[k] = (lambda k=k: engine_for(params, rows, N, args.new, k, spec_kw))
            if barriers:
                engines[k] = engines[k]()
                print(f"N={N:3d} {arm:6s} engine decode_steps={k} compiled in "
                      f"{time.perf_counter() - t1:.1f} s", flush=True)
        return N, arm, rows, gen, engines, time.perf_counter() - t0

    def measure(N, arm, rows, gen, engines, c_all):
        n_tok = len(rows) * args.new
        g_wall, g_toks = timed(gen, args.repeats)
        res = dict(N=N, arm=arm, requests=len(rows), generate_tok_s=n_tok / g_wall,
                   generate_wall_s=g_wall)
        print(f"N={N:3d} {arm:6s} generate          {n_tok / g_wall:10.1f} tok/s", flush=True)
        out["results"].append(res)
        for steps, eng in engines.items():
            if callable(eng):
                t1 = time.perf_counter()
                eng = eng()
                res[f"compile_engine_steps{steps}_s"] = time.perf_counter() - t1
                print(f"N={N:3d} {arm:6s} engine decode_steps={steps} compiled in "
                      f"{time.perf_counter() - t1:.1f} s", flush=True)
            wall, outs = timed(lambda: eng.generate(requests(rows, args.new)), args.repeats)
            m = eng.last_run
            bad = [o for o in outs if o.finish_reason != "length"]
            assert not bad, (len(bad), bad[0].finish_reason, bad[0].error)
            eng.measure_idle = True
            eng.generate(requests(rows, args.new))
            mi = eng.last_run
            eng.measure_idle = False
            same = float(np.mean([o.tokens == g.tolist() for o, g in zip(outs, g_toks)]))
            res[f"engine_steps{steps}"] = dict(
                tok_s=n_tok / wall, wall_s=wall, ratio=g_wall / wall,
                decode_calls=m.decode_calls, mean_decode_steps=m.mean_decode_steps,
                steps=m.steps, idle_fraction=mi.idle_fraction, idle_total_s=mi.idle_total_s,
                idle_steps_measured=mi.idle_steps_measured, idle_run_tok_s=mi.throughput_tokens_per_s,
                same_tokens_as_generate=same, tau=m.tau, acceptance_rate=m.acceptance_rate,
                prefill_shapes=[list(x) for x in eng.prefill_shapes])
            print(f"N={N:3d} {arm:6s} engine steps/call {steps}: {n_tok / wall:10.1f} tok/s "
                  f"({g_wall / wall:.3f}x generate)  {m.mean_decode_steps:.2f} decode steps"
                  f"/call over {m.decode_calls} calls  idle {mi.idle_fraction:.3%} of device "
                  f"time  same tokens {same:.2f}", flush=True)
            write(out)

    def write(result):
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)

    if barriers:                # compile everything, then time behind the barriers
        items = [compiled(item) for item in setups()]
        touch(args.compiled_file)
        wait_for(args.wait_for)
        for item in items:
            measure(*item)
        touch(args.done_file)
    else:                       # compile and time one arm after the other, printing as it goes
        for item in setups():
            measure(*compiled(item))
    write(out)
    if args.out:
        print("wrote", args.out)


if __name__ == "__main__":
    main()
