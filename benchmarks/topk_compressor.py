"""Indexer top-k (lax.top_k vs radix select) and the fused compressor decode step (XLA
reference, today's two `compressor_chunk` calls, Mosaic GPU kernel) on one device.

    PYTHONPATH=. python3 benchmarks/topk_compressor.py OUT.json

Each timing is a jitted fori_loop of `iters` calls (each call's input depends on the previous
output, so nothing is hoisted), wall clock after a warm-up, divided by `iters`; the loop's own
cost (the same loop around a trivial body) is reported as `loop_us`. Results are appended to
OUT.json as they come.
"""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from deepinfer_fn import kernels, kernels_xla
from deepinfer_fn.config import CSA, HCA, ModelConfig
from deepinfer_fn.model.cached import compressor_chunk
from deepinfer_fn.model.compressor import compressor_decode_step
from deepinfer_fn.model.rope import rope_frequencies
from deepinfer_fn.state import compressor_ring_slots

RESULTS: list = []


def save(path, **row):
    RESULTS.append(row)
    print(json.dumps(row), flush=True)
    with open(path, "w") as f:
        json.dump(RESULTS, f, indent=1)


def loop_time(f, first, rest, iters=100):
    """us per call of f(first, *rest) in a fori_loop carrying `first`."""
    def run(first, *rest):
        def body(_, a):
            out = f(a, *rest)
            leaf = jax.tree.leaves(out)[0].reshape(-1)[0]
            return a + (leaf == -12345).astype(a.dtype)
        return lax.fori_loop(0, iters, body, first)
    g = jax.jit(run)
    jax.block_until_ready(g(first, *rest))
    best = 1e30
    for _ in range(3):
        t = time.perf_counter()
        jax.block_until_ready(g(first, *rest))
        best = min(best, time.perf_counter() - t)
    return best / iters * 1e6


def kernel_count(f, *args):
    """Instructions of the compiled entry computation that launch work (fusions, custom
    calls, sorts, scatters, ...)."""
    text = jax.jit(f).lower(*args).compile().as_text()
    entry = text[text.index("ENTRY"):]
    entry = entry[:entry.index("\n}")]
    skip = ("parameter(", "constant(", "tuple(", "get-tuple-element(", "bitcast(")
    return sum(1 for line in entry.split("\n")[1:] if "=" in line and not any(s in line for s in skip))


def bench_topk(out):
    rng = np.random.default_rng(0)
    k = 512
    # Ties on the GPU: integer scores, many equal values.
    s = jnp.asarray(rng.integers(0, 50, (8, 1, 2048)).astype(np.float32))
    v = jnp.asarray(rng.random((8, 1, 2048)) < 0.9)
    sets = {}
    for impl in ("xla", "xla_select"):
        with kernels.use("top_k_rows", impl):
            idx = np.asarray(jax.jit(lambda s, v: kernels.top_k_rows(s, v, k))(s, v))
        sets[impl] = [sorted(int(i) for i in r if i >= 0) for r in idx.reshape(-1, k)]
    save(out, what="topk_gpu_sets_equal", equal=sets["xla"] == sets["xla_select"])
    for b in (1, 64):
        for n in (1024, 8192):
            scores = jnp.asarray(rng.standard_normal((b, 1, n)), jnp.float32)
            vis = jnp.ones((b, 1, n), bool)
            base = loop_time(lambda s, v: s[..., :1], scores, (vis,))
            for name, fn in [("xla", kernels_xla.top_k_rows),
                             ("select", kernels_xla.top_k_rows_select),
                             ("select4", lambda s, v, k: kernels_xla.top_k_rows_select(s, v, k, 4)),
                             ("select8", lambda s, v, k: kernels_xla.top_k_rows_select(s, v, k, 8))]:
                f = lambda s, v, fn=fn: fn(s, v, k)
                save(out, what="topk", impl=name, B=b, N=n, k=k, us=loop_time(f, scores, (vis,)),
                     loop_us=base, kernels=kernel_count(f, scores, vis))


def _layer(rng, cfg, layer_type, b, dtype=jnp.bfloat16):
    m = cfg.compress_ratio_of(layer_type)
    d_model = cfg.hidden_size
    dims = (cfg.head_dim, cfg.index_head_dim) if layer_type == CSA else (cfg.head_dim,)
    c = 2 if layer_type == CSA else 1
    slots = compressor_ring_slots(cfg, layer_type, cfg.sliding_window)
    w = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), dtype)
    params = tuple(dict(wkv=w(d_model, c * d), wgate=w(d_model, c * d),
                        ape=jnp.asarray(rng.standard_normal((m, c * d)), jnp.float32),
                        norm=jnp.ones((d,), dtype)) for d in dims)
    cap = 8192 // m
    states = tuple(dict(raw_kv=jnp.asarray(rng.standard_normal((b, slots, c * d)), dtype),
                        raw_gate=jnp.asarray(rng.standard_normal((b, slots, c * d)), jnp.float32),
                        rows=jnp.zeros((b, cap, d), dtype)) for d in dims)
    x = jnp.asarray(rng.standard_normal((b, d_model)), dtype)
    pos = jnp.asarray(rng.integers(1000, 4000, b), jnp.int32)
    return params, states, x, pos, m, c


def bench_compressor(out):
    cfg = ModelConfig.preset("mini")
    rng = np.random.default_rng(1)
    eps = cfg.rms_norm_eps
    for layer_type in (CSA, HCA):
        freqs = rope_frequencies(cfg, layer_type)
        for b in (1, 64):
            params, states, x, pos, m, c = _layer(rng, cfg, layer_type, b)
            rings = tuple((s["raw_kv"], s["raw_gate"]) for s in states)
            overlap = layer_type == CSA

            def chunk(x, pos, states):          # today: one compressor_chunk per compressor
                n_new = jnp.ones_like(pos)
                return [compressor_chunk(p, x[:, None], pos, n_new, m, overlap, freqs, eps, st)
                        for p, st in zip(params, states)]

            def fused(x, pos, states, impl):     # the fused op + the same state writes
                with kernels.use("compressor_decode", impl):
                    steps = compressor_decode_step(
                        params, x, pos, tuple((s["raw_kv"], s["raw_gate"]) for s in states),
                        m, freqs, eps)
                put = jax.vmap(lambda r, i, v: r.at[i].set(v.astype(r.dtype), mode="drop"))
                res = []
                for st, e in zip(states, steps):
                    cap = st["rows"].shape[1]
                    res.append(dict(raw_kv=put(st["raw_kv"], e["slot"], e["raw_kv"]),
                                    raw_gate=put(st["raw_gate"], e["slot"], e["raw_gate"]),
                                    rows=put(st["rows"], jnp.where(e["complete"], e["row_index"],
                                                                   cap), e["row"])))
                return res

            def op(x, pos, impl, **kw):
                if impl == "xla":
                    return kernels_xla.compressor_decode(x, pos, params, rings, m, freqs, eps)
                fn = kernels.implementation("compressor_decode", "mosaic_gpu")
                return fn(x, pos, params, rings, m, freqs, eps, **kw)

            want = op(x, pos, "xla")
            got = op(x, pos, "mosaic_gpu")
            err = [float(jnp.linalg.norm((g[2] - w_[2]).astype(jnp.float32))
                         / jnp.linalg.norm(w_[2].astype(jnp.float32))) for g, w_ in zip(got, want)]
            kv_eq = [bool(jnp.all(g[0] == w_[0])) for g, w_ in zip(got, want)]
            save(out, what="compressor_check", layer=layer_type, B=b, row_rel_err=err,
                 kappa_equal=kv_eq)
            base = loop_time(lambda x, pos: x[:, :1], x, (pos,))
            variants = [("op_xla", lambda x, pos: op(x, pos, "xla")),
                        ("op_mgpu", lambda x, pos: op(x, pos, "mosaic_gpu")),
                        ("op_mgpu_tn64", lambda x, pos: op(x, pos, "mosaic_gpu", tn=64)),
                        ("today_chunks_with_writes", lambda x, pos: chunk(x, pos, states)),
                        ("fused_xla_with_writes", lambda x, pos: fused(x, pos, states, "xla")),
                        ("fused_mgpu_with_writes",
                         lambda x, pos: fused(x, pos, states, "mosaic_gpu"))]
            if layer_type == HCA:
                variants.insert(2, ("op_mgpu_splits16",
                                    lambda x, pos: op(x, pos, "mosaic_gpu", splits=16)))
                variants.insert(2, ("op_mgpu_splits1",
                                    lambda x, pos: op(x, pos, "mosaic_gpu", splits=1)))
            for name, f in variants:
                try:
                    save(out, what="compressor", layer=layer_type, B=b, impl=name,
                         us=loop_time(f, x, (pos,)), loop_us=base, kernels=kernel_count(f, x, pos))
                except Exception as e:  # noqa: BLE001 - report and go on
                    save(out, what="compressor", layer=layer_type, B=b, impl=name,
                         error=f"{type(e).__name__}: {str(e)[:300]}")


if __name__ == "__main__":
    path = sys.argv[1] if len(sys.argv) > 1 else "topk_compressor.json"
    print(jax.devices(), flush=True)
    bench_topk(path)
    bench_compressor(path)
