"""Command line: `python -m deepinfer_fn {info,forward} ...`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _load(model: str, dtype_name: str):
    import jax
    import jax.numpy as jnp
    import deepinfer_fn as di
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype_name]
    if os.path.isdir(model):
        return di.load_params(model, dtype=dtype, progress=True)
    cfg = di.ModelConfig.preset(model)
    return di.init_params(cfg, jax.random.key(0), dtype=dtype)


def cmd_info(args) -> int:
    import deepinfer_fn as di
    cfg = (di.ModelConfig.from_hf(args.model) if os.path.isdir(args.model)
           else di.ModelConfig.preset(args.model))
    counts = di.count_params(cfg)
    print(json.dumps({"model": args.model, **counts,
                      "layers": {t: cfg.layer_types.count(t) for t in set(cfg.layer_types)}},
                     indent=2))
    return 0


def cmd_forward(args) -> int:
    import numpy as np
    import deepinfer_fn as di
    params = _load(args.model, args.dtype)
    ids = np.array([[int(t) for t in args.tokens.split(",")]], np.int32)
    t0 = time.perf_counter()
    logits = np.asarray(di.forward(params, ids))
    print(f"logits {logits.shape} in {time.perf_counter() - t0:.2f}s; "
          f"next-token argmax per position: {logits[0].argmax(-1).tolist()}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepinfer_fn")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="parameter counts and layer schedule of a preset or checkpoint")
    p.add_argument("--model", default="v4-flash", help="preset name or HF checkpoint directory")
    p.set_defaults(fn=cmd_info)
    p = sub.add_parser("forward", help="logits of a comma-separated token list (no cache)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--tokens", default="1,2,3,4,5")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.set_defaults(fn=cmd_forward)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
