"""Prefill / decode separation in one process: a prefill engine and a decode engine side by side.

The prefill engine runs every request's prefill and samples its first token
(`Engine.prefill` -> `RequestState`, host arrays); the states are pickled (what another process
would receive) and the decode engine continues them (`Engine.generate`). A single engine runs the
same requests end to end; the script prints, per request, whether the tokens are equal and the
bytes moved (per-slot rings, pages, drafter state, tokens), then the wall times of each phase.
Exit status 1 when any request's tokens differ.

Model: the embedded default model (`load_model()`, float32), random prompt token ids, greedy by
default (`--temperature` > 0 samples with per-request seeds). On the CPU the defaults run in
well under a minute once compiled (the compilation cache `--cache-dir` keeps the programs):

    python benchmarks/prefill_decode.py
    python benchmarks/prefill_decode.py --requests 8 --prompt-len 100 --new 16 --temperature 0.8
    python benchmarks/prefill_decode.py --speculative mtp          # speculative engines (γ = 3)
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=40, help="mean prompt length (tokens)")
    p.add_argument("--new", type=int, default=8, help="tokens generated per request")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--budget", type=int, default=64, help="max_tokens_per_step")
    p.add_argument("--chunk", type=int, default=32, help="prefill chunk width")
    p.add_argument("--speculative", choices=("none", "mtp", "dspark"), default="none")
    p.add_argument("--platform", default="cpu",
                   help="JAX_PLATFORMS (cpu: XLA backend optimisations off, faster compiles)")
    p.add_argument("--cache-dir", default=os.path.join(ROOT, ".jax_cache"),
                   help="persistent compilation cache ('' = off)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    for name in ("requests", "prompt_len", "new", "max_batch", "page_size", "max_len", "budget",
                 "chunk"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.prompt_len + a.prompt_len // 2 + a.new > a.max_len:
        p.error("--max-len must hold the longest prompt (1.5 x --prompt-len) + --new")
    return a


def setup_jax(a):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if a.platform:
        os.environ["JAX_PLATFORMS"] = a.platform
    flags = os.environ.get("XLA_FLAGS", "")
    if a.platform == "cpu" and "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_backend_optimization_level=0").strip()
    import jax
    if a.cache_dir:
        jax.config.update("jax_compilation_cache_dir", a.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return jax


def make_requests(a, vocab: int):
    import numpy as np
    from deepinfer_fn.engine import Request
    rng = np.random.default_rng(a.seed)
    lens = rng.integers(max(1, a.prompt_len // 2), a.prompt_len + a.prompt_len // 2 + 1,
                        a.requests)
    return [Request(rng.integers(2, vocab, int(n)).tolist(), max_new_tokens=a.new,
                    temperature=a.temperature, seed=a.seed + i, request_id=i)
            for i, n in enumerate(lens)]


def breakdown(rs) -> str:
    b = lambda arrs: sum(x.nbytes for x in arrs)
    parts = [f"rings {b(rs.rings):,}", f"pages {b(rs.pages):,} ({rs.num_pages} pages)"]
    if rs.drafter:
        parts.append(f"drafter {b(rs.drafter):,}")
    parts.append(f"tokens {b((rs.prompt, rs.generated, rs.logprobs)):,}")
    return ", ".join(parts)


def main(argv=None) -> int:
    a = parse_args(argv)
    setup_jax(a)
    import jax.numpy as jnp
    import deepinfer_fn as di
    from deepinfer_fn.engine import Engine, RequestState

    model = di.load_model(dtype=jnp.float32)
    spec = None if a.speculative == "none" else a.speculative
    kw = dict(max_batch=a.max_batch, page_size=a.page_size, max_len=a.max_len,
              max_tokens_per_step=a.budget, prefill_shapes=((min(2, a.max_batch), a.chunk),),
              decode_buckets=(a.max_batch,), progress=False, speculative=spec)
    if spec == "mtp":
        kw["num_draft_tokens"] = 3
    prefill_engine, decode_engine, single = (Engine(model, **kw) for _ in range(3))
    reqs = make_requests(a, model.params.config.vocab_size)

    t0 = time.perf_counter()
    want = single.generate(reqs)
    t_single = time.perf_counter() - t0

    t0 = time.perf_counter()
    states = prefill_engine.prefill(reqs)
    t_prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    wire = pickle.dumps(states)
    received = pickle.loads(wire)
    t_wire = time.perf_counter() - t0
    moved = [s for s in received if isinstance(s, RequestState)]
    t0 = time.perf_counter()
    outs = {o.request_id: o for o in decode_engine.generate(moved)}
    t_decode = time.perf_counter() - t0
    for s in received:                      # requests that ended in prefill: their outputs
        if not isinstance(s, RequestState):
            outs[s.request_id] = s

    print(f"prefill engine -> decode engine: {len(reqs)} requests, {a.new} new tokens each, "
          f"speculative={a.speculative}, T={a.temperature}")
    ok = True
    for r, w in zip(reqs, want):
        o, st = outs[r.request_id], next((s for s in moved if s.request.request_id == r.request_id),
                                         None)
        same = o.tokens == w.tokens
        ok &= same
        moved_s = (f"{st.nbytes:>9,} bytes moved ({breakdown(st)})" if st is not None
                   else "finished in prefill")
        print(f"  request {r.request_id}: prompt {len(r.tokens):>3}, tokens "
              f"{'equal' if same else 'DIFFER'}  {moved_s}")
        if not same:
            print(f"    single {w.tokens}\n    split  {o.tokens}")
    total = sum(s.nbytes for s in moved)
    print(f"bytes moved: {total:,} in all ({total / max(len(moved), 1):,.0f} per request; "
          f"pickled {len(wire):,})")
    print(f"wall: single engine {t_single:.2f}s | prefill {t_prefill:.2f}s, pickle round trip "
          f"{t_wire * 1e3:.1f} ms, decode {t_decode:.2f}s (first calls include compilation)")
    print("tokens equal to a single engine" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
