"""Command line: `python -m deepinfer_fn {generate,info,forward} ...`."""

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


def _model_and_tokenizer(model: str | None, dtype_name: str):
    """(params, tokenizer) for a checkpoint directory, a preset (random weights), or the
    embedded default model when `model` is None."""
    from deepinfer_fn import text
    if model is None:
        from deepinfer_fn.default_model import default_model_path
        model = default_model_path()
    params = _load(model, dtype_name)
    if os.path.isdir(model) and os.path.exists(os.path.join(model, "tokenizer.json")):
        tok = text.load_tokenizer(model)
    elif params.config.vocab_size == 129280:
        tok = text.load_tokenizer()  # the real DeepSeek-V4 vocabulary
    else:
        raise SystemExit(f"{model}: no tokenizer.json and vocab_size {params.config.vocab_size} "
                         "is not the V4 vocabulary; pass a checkpoint directory with a tokenizer")
    if tok.vocab_size > params.config.vocab_size:
        raise SystemExit(f"tokenizer has {tok.vocab_size} ids but the model only "
                         f"{params.config.vocab_size}")
    return params, tok


def cmd_generate(args) -> int:
    import numpy as np
    from tqdm.auto import tqdm
    import deepinfer_fn as di
    params, tok = _model_and_tokenizer(args.model, args.dtype)
    if args.chat:
        ids = tok.apply_chat([{"role": "user", "content": args.prompt}], thinking=args.thinking)
    else:
        ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(args.prompt)
    if not ids:
        raise SystemExit("empty prompt")
    stops = [tok.eos_id] if tok.eos_id is not None and not args.ignore_eos else []
    prompt = np.asarray([ids], np.int32)
    decoder = tok.stream_decoder()
    bar = tqdm(total=args.max_new_tokens, unit="tok", desc="generate", leave=False,
               disable=args.quiet or None, file=sys.stderr)
    t0 = time.perf_counter()
    first, first_count = None, 0
    n = 0
    if not args.chat:
        sys.stdout.write(args.prompt)
    for out in di.stream_generate(params, prompt, max_new_tokens=args.max_new_tokens,
                                  block=args.block, temperature=args.temperature,
                                  top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                                  seed=args.seed, stop_tokens=stops):
        count = int(out.lengths[0])
        if first is None:
            first, first_count = time.perf_counter(), count
        for token in np.asarray(out.tokens[0, :count]).tolist():
            if token in stops:
                continue
            sys.stdout.write(decoder.push(token))
        sys.stdout.flush()
        n += count
        bar.update(count)
    sys.stdout.write(decoder.flush() + "\n")
    bar.close()
    end = time.perf_counter()
    if not args.quiet:
        steady = (n - first_count) / (end - first) if n > first_count and end > first else float("nan")
        print(f"[prompt {len(ids)} tokens; {n} new tokens in {end - t0:.2f}s; first block "
              f"(prefill + compilation) {first - t0:.2f}s; decode {steady:.1f} tok/s after it]",
              file=sys.stderr)
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
    p = sub.add_parser("generate", help="generate text (default: the embedded default model)")
    p.add_argument("--model", default=None,
                   help="checkpoint directory or preset name (default: the embedded model)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="render the prompt as a user chat turn")
    p.add_argument("--thinking", action="store_true", help="chat in thinking mode")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block", type=int, default=16, help="decode steps per device call")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(fn=cmd_generate)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
