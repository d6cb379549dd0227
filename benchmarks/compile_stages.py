"""Where a decode-step compile stalls: prints a timestamp after each stage (import, params,
state, lower, XLA compile, first run) of the embedded default model's one-token
`forward_chunk` (batch 16, bf16, state donated), and dumps the Python stack after $DUMP_AFTER
seconds (default 170) so a run stopped by a time limit still says which stage it was in.

    DEEPINFER_COMPILE_CACHE=0 python benchmarks/compile_stages.py
    PRESET=tiny python benchmarks/compile_stages.py                  # a preset, random weights
    NUMERICS=serving python benchmarks/compile_stages.py             # override cfg.numerics
    LAYERS=compressed_sparse_attention:moe python benchmarks/compile_stages.py
        # a one-layer model of the default model's sizes (attention type:mlp type, comma list)
    PART=mhc ITERS=20 python benchmarks/compile_stages.py            # one mHC pre + post alone
    SINKHORN=scalar_barrier python benchmarks/compile_stages.py      # a Sinkhorn variant (below)
    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=hlo_pass_pipeline=1 python benchmarks/compile_stages.py
        # XLA logs every HLO pass with its time: the last pass started is the one that stalls

`benchmarks/compile_bisect.sh` runs sets of these variants at once in one device call.
Findings on the H200 are in benchmarks/results/compile_stages_h200.json.
"""

import dataclasses
import faulthandler
import os
import re
import time

faulthandler.dump_traceback_later(float(os.environ.get("DUMP_AFTER", "170")), exit=False)
T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {message}", flush=True)


def main() -> None:
    log("start")
    import jax
    import jax.numpy as jnp
    log(f"jax imported {jax.__version__} {jax.devices()}")
    import deepinfer_fn as di
    from deepinfer_fn.model import transformer
    from deepinfer_fn.state import init_state
    log("deepinfer_fn imported")
    if os.environ.get("SINKHORN"):
        from deepinfer_fn.model import mhc_math
        mhc_math.sinkhorn = SINKHORNS[os.environ["SINKHORN"]](jax, jnp, mhc_math.sinkhorn)
        log(f"sinkhorn variant {os.environ['SINKHORN']}")
    if os.environ.get("PRESET"):
        params = di.init_params(di.ModelConfig.preset(os.environ["PRESET"]), jax.random.key(0),
                                dtype=jnp.bfloat16)
    else:
        params = di.load_params(di.default_model_path(), dtype=jnp.bfloat16)
    if os.environ.get("NUMERICS"):
        params = dataclasses.replace(params, config=dataclasses.replace(
            params.config, numerics=os.environ["NUMERICS"]))
    if os.environ.get("LAYERS"):
        kinds = [k.split(":") for k in os.environ["LAYERS"].split(",")]
        cfg = dataclasses.replace(params.config, num_hidden_layers=len(kinds),
                                  layer_types=tuple(a for a, _ in kinds),
                                  mlp_layer_types=tuple(m for _, m in kinds))
        params = di.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16)
    cfg = params.config
    log(f"params loaded numerics={cfg.numerics} layers={cfg.layer_types} {cfg.mlp_layer_types}")
    if os.environ.get("PART") == "mhc":
        return mhc_only(jax, jnp, params, int(os.environ.get("ITERS", cfg.hc_sinkhorn_iters)))
    B, S = 16, 1
    state = init_state(cfg, B, 528, window_slots=cfg.sliding_window + 6, dtype=jnp.bfloat16)
    jax.block_until_ready(state)
    log("state")
    ids, n_new = jnp.zeros((B, S), jnp.int32), jnp.full((B,), S, jnp.int32)
    fwd = jax.jit(lambda p, s, i, n: transformer.forward_chunk(p, s, i, n)[:2],
                  donate_argnums=(1,))
    lowered = fwd.lower(params, state, ids, n_new)
    log("lowered")
    compiled = lowered.compile()
    log(f"compiled; launched ops {launched_ops(compiled.as_text())}")
    for _ in range(3):
        _, state = compiled(params, state, ids, n_new)
    jax.block_until_ready(state)
    t = time.perf_counter()
    for _ in range(20):
        _, state = compiled(params, state, ids, n_new)
    jax.block_until_ready(state)
    log(f"ran; step {(time.perf_counter() - t) / 20 * 1e3:.3f} ms")


def launched_ops(hlo_text: str) -> dict:
    """Fusions, custom calls and other thunk-like ops outside fused computations of a compiled
    module's text (a rough count of kernels per call)."""
    counts: dict = {}
    inside_fused = False
    for line in hlo_text.splitlines():
        if line and not line.startswith(" "):
            inside_fused = "fused" in line.split("(")[0] or "region" in line.split("(")[0]
            continue
        if inside_fused or " = " not in line:
            continue
        found = re.search(r"(?:^|[\s}\])])([a-z][a-z0-9-]*)\(", line.split(" = ", 1)[1])
        op = found.group(1) if found else "?"
        if op in ("fusion", "custom-call", "while", "conditional", "all-to-all", "copy", "gather",
                  "scatter", "sort", "dot", "reduce"):
            counts[op] = counts.get(op, 0) + 1
    return counts


def mhc_only(jax, jnp, params, iters: int) -> None:
    """Compiles one mHC pre (weights, Sinkhorn, collapse, norm) + post (expand) of layer 0's
    attention side on streams [16, n, D]."""
    from deepinfer_fn import kernels
    cfg = params.config
    lp = params["layers"][0]
    hc = lp["hc_attn"]
    streams = jnp.ones((16, cfg.hc_mult, cfg.hidden_size), jnp.bfloat16)

    def f(streams, hc, norm):
        h, post, comb = kernels.mhc_pre(streams, hc["fn"], hc["base"], hc["scale"], norm,
                                        iters=iters, hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
        return kernels.mhc_post(streams, h, post, comb)
    lowered = jax.jit(f).lower(streams, hc, lp["attn_norm"])
    log(f"lowered mhc (iters={iters})")
    compiled = lowered.compile()
    log(f"compiled; launched ops {launched_ops(compiled.as_text())}")


def _unrolled_barrier(jax, jnp, reference):
    return lambda logits, iters, eps: jax.lax.optimization_barrier(reference(logits, iters, eps))


def _scalar(jax, jnp, reference, barrier=False):
    """The n x n Sinkhorn on n*n separate [...] arrays: elementwise ops only, one index."""
    def sinkhorn(logits, iters, eps):
        n = logits.shape[-1]
        x = [[logits[..., j, k] for k in range(n)] for j in range(n)]

        def total(vals):
            out = vals[0]
            for v in vals[1:]:
                out = out + v
            return out
        p = []
        for row in x:
            m = row[0]
            for v in row[1:]:
                m = jnp.maximum(m, v)
            e = [jnp.exp(v - m) for v in row]
            s = total(e)
            p.append([v / s + eps for v in e])

        def columns(p):
            c = [total([p[j][k] for j in range(n)]) + eps for k in range(n)]
            return [[p[j][k] / c[k] for k in range(n)] for j in range(n)]

        def rows(p):
            return [[v / (total(row) + eps) for v in row] for row in p]
        p = columns(p)
        for _ in range(iters - 1):
            p = columns(rows(p))
        out = jnp.stack([jnp.stack(row, -1) for row in p], -2)
        return jax.lax.optimization_barrier(out) if barrier else out
    return sinkhorn


def _loop(jax, jnp, reference):
    def sinkhorn(logits, iters, eps):
        p = jax.nn.softmax(logits, axis=-1) + eps
        p = p / (p.sum(axis=-2, keepdims=True) + eps)

        def step(_, p):
            p = p / (p.sum(axis=-1, keepdims=True) + eps)
            return p / (p.sum(axis=-2, keepdims=True) + eps)
        return jax.lax.fori_loop(0, iters - 1, step, p)
    return sinkhorn


def _chunked(jax, jnp, reference, every=5):
    """Unrolled with a barrier after every `every` iterations."""
    def sinkhorn(logits, iters, eps):
        p = jax.nn.softmax(logits, axis=-1) + eps
        p = p / (p.sum(axis=-2, keepdims=True) + eps)
        for i in range(iters - 1):
            p = p / (p.sum(axis=-1, keepdims=True) + eps)
            p = p / (p.sum(axis=-2, keepdims=True) + eps)
            if (i + 1) % every == 0 or i == iters - 2:
                p = jax.lax.optimization_barrier(p)
        return p
    return sinkhorn


SINKHORNS = {
    "barrier": _unrolled_barrier,
    "chunk5": _chunked,
    "chunk10": lambda jax, jnp, ref: _chunked(jax, jnp, ref, every=10),
    "scalar": _scalar,
    "scalar_barrier": lambda jax, jnp, ref: _scalar(jax, jnp, ref, barrier=True),
    "loop": _loop,
}


if __name__ == "__main__":
    main()
