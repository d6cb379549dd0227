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
    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=hlo_pass_pipeline=1 python benchmarks/compile_stages.py
        # XLA logs every HLO pass with its time: the last pass started is the one that stalls

Findings on the H200 are in benchmarks/results/compile_stages_h200.json.
"""

import dataclasses
import faulthandler
import os
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
    log("compiled")
    jax.block_until_ready(compiled(params, state, ids, n_new))
    log("ran")


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
    lowered.compile()
    log("compiled")


if __name__ == "__main__":
    main()
