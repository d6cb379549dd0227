"""Command line: `python -m deepinfer_fn {generate,info,forward,precompile,batch} ...`.

Errors: a bad argument prints one `... error: ...` line on stderr and exits 2 (argparse-level
checks of types and ranges, then the checks that need the model: `--model` resolution, token
ids inside the vocabulary); any other error the library raises prints one line and exits 1.
`DEEPINFER_DEBUG=1` re-raises instead, with the traceback.

`--model` takes an existing checkpoint directory, a preset name (random weights) or a
Hugging Face hub id `org/name`, looked up in the local hub cache (downloaded only when
`HF_HUB_OFFLINE` is unset); a stderr line says which it was (not with `--quiet`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

PROG = "python -m deepinfer_fn"


class UsageError(Exception):
    """A bad command-line argument found after parsing (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block) and exit status 2."""

    def error(self, message):
        _fail(f"{self.prog}: error: {message}", 2)


def _fail(line: str, code: int):
    sys.stderr.write(" ".join(line.split()) + "\n")
    sys.exit(code)


# ------------------------------------------------------------------ argument types
def _typed(kind, name: str, ok, allowed: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}")
        return value
    parse.__name__ = name            # argparse names the type in some messages
    return parse


positive_int = _typed(int, "positive int", lambda v: v >= 1, "a positive integer")
nonneg_int = _typed(int, "non-negative int", lambda v: v >= 0, "an integer >= 0")
seed_int = _typed(int, "seed", lambda v: 0 <= v < 2**32, "an integer in [0, 2**32)")
temperature_float = _typed(float, "temperature", lambda v: math.isfinite(v) and v >= 0,
                           "a finite number >= 0 (0 = greedy)")
top_p_float = _typed(float, "top-p", lambda v: 0 < v <= 1, "a number in (0, 1] (1 = off)")
min_p_float = _typed(float, "min-p", lambda v: 0 <= v < 1, "a number in [0, 1) (0 = off)")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _token_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token ids, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected non-negative token ids, got {text!r}")
    return values


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


# ------------------------------------------------------------------ --model
def _presets() -> tuple[str, ...]:
    from deepinfer_fn.config import ModelConfig
    return ModelConfig.presets()


def _hub_snapshot(repo: str, quiet: bool) -> str:
    """The local snapshot directory of hub repo `org/name` (`bundle.hub_snapshot`: the cache
    first, a download only when HF_HUB_OFFLINE is unset); UsageError when neither works."""
    from deepinfer_fn import bundle
    from deepinfer_fn.checkpoint import CheckpointError

    def say(message):
        _say(quiet, f"model: {message}")
    try:
        return bundle.hub_snapshot(repo, on_download=say)
    except CheckpointError as e:
        raise UsageError(f"--model {repo}: {e}") from e


def resolve_model(model: str | None, quiet: bool) -> tuple[str | None, str, str]:
    """(checkpoint dir or None, preset name or None, description) for --model: an existing
    directory, the embedded default model (None), a preset, or a hub id (its snapshot
    directory in the hub cache). UsageError for anything else."""
    if model is None:
        from deepinfer_fn.default_model import default_model_path
        path = default_model_path()
        return path, None, f"model: the embedded default model ({path})"
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        return path, None, f"model: checkpoint directory {os.path.abspath(path)}"
    if os.path.exists(path):
        raise UsageError(f"--model {model}: is a file, not a checkpoint directory (pass the "
                         "directory that holds config.json)")
    from deepinfer_fn import bundle
    presets = _presets()
    if model in presets:
        return None, model, f"model: preset {model!r}"
    if bundle.is_hub_id(model) and not model.startswith("."):
        snapshot = _hub_snapshot(model, quiet)
        return snapshot, None, f"model: hub id {model} (snapshot {snapshot})"
    if os.sep in model or model.startswith((".", "~")):
        raise UsageError(f"--model {model}: no such directory")
    raise UsageError(f"--model {model!r}: not a directory, a preset ({', '.join(presets)}) or "
                     "a hub id (org/name)")


def _config(model):
    """The ModelConfig of a resolved --model."""
    from deepinfer_fn.config import ModelConfig
    ckpt, preset, _ = model
    return ModelConfig.from_hf(ckpt) if ckpt is not None else ModelConfig.preset(preset)


def _say(quiet: bool, line: str) -> None:
    if not quiet:
        print(line, file=sys.stderr)


def _load(model, dtype_name: str, quiet: bool):
    """Params of a resolved --model (`resolve_model`); says which model on stderr first."""
    import jax
    import jax.numpy as jnp
    import deepinfer_fn as di
    ckpt, preset, description = model
    _say(quiet, description if ckpt is not None
         else f"{description} with random weights (not a trained model)")
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype_name]
    if ckpt is not None:
        return di.load_params(ckpt, dtype=dtype, progress=not quiet)
    return di.init_params(di.ModelConfig.preset(preset), jax.random.key(0), dtype=dtype)


# ------------------------------------------------------------------ commands
def cmd_info(args) -> int:
    import deepinfer_fn as di
    model = resolve_model(args.model, args.quiet)
    cfg = _config(model)
    _say(args.quiet, model[2])
    counts = di.count_params(cfg)
    print(json.dumps({"model": args.model, **counts,
                      "layers": {t: cfg.layer_types.count(t) for t in set(cfg.layer_types)}},
                     indent=2))
    return 0


def cmd_forward(args) -> int:
    import numpy as np
    import deepinfer_fn as di
    model = resolve_model(args.model, args.quiet)
    vocab = _config(model).vocab_size
    bad = [t for t in args.tokens if t >= vocab]
    if bad:
        raise UsageError(f"--tokens: ids {bad} are outside the model's vocabulary [0, {vocab})")
    params = _load(model, args.dtype, args.quiet)
    ids = np.array([args.tokens], np.int32)
    t0 = time.perf_counter()
    logits = np.asarray(di.forward(params, ids))
    _say(args.quiet, f"logits {logits.shape} in {time.perf_counter() - t0:.2f}s")
    print(f"next-token argmax per position: {logits[0].argmax(-1).tolist()}")
    return 0


def _tokenizer(model, arg: str | None):
    """The tokenizer of a resolved --model (`arg`: what the user passed, for messages)."""
    from deepinfer_fn import text
    ckpt = model[0]
    vocab = _config(model).vocab_size
    if ckpt is not None and os.path.exists(os.path.join(ckpt, "tokenizer.json")):
        tok = text.load_tokenizer(ckpt)
    elif vocab == 129280:
        # the real DeepSeek-V4 vocabulary, rendering chats in the model's format
        tok = text.load_tokenizer(chat_encoding=text.chat_encoding_of(_config(model)))
    else:
        raise UsageError(f"--model {arg}: no tokenizer.json and vocab_size {vocab} is not the "
                         "V4 vocabulary; pass a checkpoint directory with a tokenizer")
    if tok.vocab_size > vocab:
        raise UsageError(f"--model {arg}: the tokenizer has {tok.vocab_size} ids but the "
                         f"model only {vocab}")
    return tok


def cmd_generate(args) -> int:
    import numpy as np
    from tqdm.auto import tqdm
    import deepinfer_fn as di
    model = resolve_model(args.model, args.quiet)
    tok = _tokenizer(model, args.model)
    if args.chat:
        ids = tok.apply_chat([{"role": "user", "content": args.prompt}], thinking=args.thinking)
    else:
        ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(args.prompt)
    if not ids:
        raise UsageError("--prompt: empty prompt (no tokens)")
    params = _load(model, args.dtype, args.quiet)
    stops = [tok.eos_id] if tok.eos_id is not None and not args.ignore_eos else []
    prompt = np.asarray([ids], np.int32)
    decoder = tok.stream_decoder()
    bar = None if args.quiet else tqdm(total=args.max_new_tokens, unit="tok", desc="generate",
                                       leave=False, file=sys.stderr, disable=None)
    t0 = time.perf_counter()
    first, first_count = None, 0
    n = 0
    outputs = di.stream_generate(params, prompt, max_new_tokens=args.max_new_tokens,
                                 block=args.block, temperature=args.temperature,
                                 top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                                 seed=args.seed, stop_tokens=stops)
    if not args.chat and not args.quiet:
        sys.stdout.write(args.prompt)
    for out in outputs:
        count = int(out.lengths[0])
        if first is None:
            first, first_count = time.perf_counter(), count
        for token in np.asarray(out.tokens[0, :count]).tolist():
            if token in stops:
                continue
            sys.stdout.write(decoder.push(token))
        sys.stdout.flush()
        n += count
        if bar is not None:
            bar.update(count)
    sys.stdout.write(decoder.flush() + "\n")
    if bar is not None:
        bar.close()
    end = time.perf_counter()
    if not args.quiet:
        steady = (n - first_count) / (end - first) if n > first_count and end > first else float("nan")
        print(f"[prompt {len(ids)} tokens; {n} new tokens in {end - t0:.2f}s; first block "
              f"(prefill + compilation) {first - t0:.2f}s; decode {steady:.1f} tok/s after it]",
              file=sys.stderr)
    return 0


def cmd_precompile(args) -> int:
    """Compiles a deployment's programs into the persistent cache (later processes load them)."""
    import jax
    import deepinfer_fn as di
    from deepinfer_fn.compile_cache import ProgramCounter, precompile
    from deepinfer_fn.generate import generate_programs
    cache = jax.config.jax_compilation_cache_dir
    if not cache:
        raise UsageError("precompile: the persistent compilation cache is disabled "
                         "(DEEPINFER_COMPILE_CACHE); nothing would be kept")
    params = _load(resolve_model(args.model, args.quiet), args.dtype, args.quiet)
    t0 = time.perf_counter()
    with ProgramCounter() as counter:
        jobs = [job for b in args.batch for t in args.prompt_len
                for job in generate_programs(params, b, t, args.max_new_tokens,
                                             block=args.block, num_stop_tokens=1)]
        precompile(jobs)
        if args.engine:
            di.Engine(params, max_batch=args.max_batch, progress=False).warmup()
    print(json.dumps({"cache_dir": cache, "programs": counter.programs,
                      "loaded_from_cache": counter.disk_hits,
                      "seconds": round(time.perf_counter() - t0, 2)}))
    return 0


def cmd_batch(args) -> int:
    """Runs a JSONL file of API requests (deepinfer_fn.batch) into a JSONL file of results."""
    import jax.numpy as jnp
    from deepinfer_fn import batch
    if not os.path.isfile(args.input):
        raise UsageError(f"{args.input}: no such file (a JSONL file of requests)")
    if args.output != "-" and os.path.isdir(args.output):
        raise UsageError(f"--output {args.output}: is a directory")
    if args.output == "-" and args.resume:
        raise UsageError("--resume needs an --output file, not stdout")
    if args.resume and args.overwrite:
        raise UsageError("pass --resume or --overwrite, not both")
    if (args.output != "-" and os.path.exists(args.output) and os.path.getsize(args.output) > 0
            and not (args.resume or args.overwrite)):
        raise UsageError(f"--output {args.output}: exists; pass --resume to continue it or "
                         "--overwrite to replace it")
    if args.drafter is not None and args.speculative != "dspark":
        raise UsageError("--drafter needs --speculative dspark")
    bad = sorted(set(args.engine_options) & {"speculative", "drafter", "tokenizer", "progress"})
    if bad:
        raise UsageError(f"--engine-options: {bad} are set by batch itself (use --speculative / "
                         "--drafter)")
    ckpt, preset, description = resolve_model(args.model, args.quiet)
    if ckpt is None:
        raise UsageError(f"--model {args.model}: batch needs a checkpoint directory with a "
                         f"tokenizer, not a preset with random weights")
    _say(args.quiet, description)
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    model = batch.load_batch_model(ckpt, dtype=dtype, speculative=args.speculative,
                                   drafter=args.drafter)
    engine_options = {k: v for k, v in (("max_batch", args.max_batch), ("max_len", args.max_len),
                                        ("max_tokens_per_step", args.max_tokens_per_step),
                                        ("prefill_chunk", args.prefill_chunk)) if v is not None}
    engine_options.update(args.engine_options)
    summary = batch.run_batch_file(
        args.input, args.output, model, resume=args.resume, overwrite=args.overwrite,
        order=args.order, progress=not args.quiet, engine_options=engine_options,
        default_format=args.format, default_thinking=not args.no_thinking,
        default_max_tokens=args.max_tokens, created=args.created, window=args.window)
    print(json.dumps(summary), file=sys.stderr if args.output == "-" else sys.stdout)
    return 0


# ------------------------------------------------------------------ parser
MODEL_HELP = ("checkpoint directory, preset name ({presets}; random weights) or Hugging Face "
              "hub id org/name (from the local hub cache; downloaded only if HF_HUB_OFFLINE "
              "is unset)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    model_help = MODEL_HELP.format(presets=", ".join(_presets()))

    def common(p, model_default, dtype=True):
        p.add_argument("--model", default=model_default, help=model_help + (
            "; default: the embedded default model" if model_default is None
            else f"; default {model_default}"))
        if dtype:
            p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
        p.add_argument("--quiet", action="store_true",
                       help="no progress bars, model line or summary; stdout holds only the "
                            "result (generate: the generated text, without the prompt)")

    p = sub.add_parser("info", help="parameter counts and layer schedule of a preset or checkpoint")
    common(p, "v4-flash", dtype=False)
    p.set_defaults(fn=cmd_info)
    p = sub.add_parser("forward", help="logits of a comma-separated token list (no cache)")
    common(p, "tiny")
    p.add_argument("--tokens", default=[1, 2, 3, 4, 5], type=_token_list,
                   help="comma-separated token ids, e.g. 1,2,3")
    p.set_defaults(fn=cmd_forward)
    p = sub.add_parser("generate", help="generate text (default: the embedded default model)")
    common(p, None)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="render the prompt as a user chat turn")
    p.add_argument("--thinking", action="store_true", help="chat in thinking mode")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--temperature", type=temperature_float, default=0.0,
                   help="0 = greedy (default)")
    p.add_argument("--top-k", type=nonneg_int, default=None, help="0 = off")
    p.add_argument("--top-p", type=top_p_float, default=None, help="in (0, 1]; 1 = off")
    p.add_argument("--min-p", type=min_p_float, default=None, help="in [0, 1); 0 = off")
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--block", type=positive_int, default=16,
                   help="decode steps per device call")
    p.add_argument("--ignore-eos", action="store_true")
    p.set_defaults(fn=cmd_generate)
    p = sub.add_parser("precompile", help="compile a deployment's programs into the persistent "
                                          "compilation cache")
    common(p, None)
    p.add_argument("--batch", type=_int_list, default=[1], help="batch sizes, e.g. 1,8")
    p.add_argument("--prompt-len", type=_int_list, default=[128],
                   help="prompt lengths (bucketed to powers of two), e.g. 32,512")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--block", type=positive_int, default=16,
                   help="decode steps per device call (as `generate --block`)")
    p.add_argument("--engine", action="store_true", help="also the Engine's sub-step shapes")
    p.add_argument("--max-batch", type=positive_int, default=16, help="the Engine's max_batch")
    p.set_defaults(fn=cmd_precompile)
    p = sub.add_parser("batch", help="run a JSONL file of OpenAI / Anthropic API requests "
                                     "(chat completions, Responses, Messages, batch lines)")
    common(p, None)
    p.add_argument("input", help="JSONL file, one request per line")
    p.add_argument("--output", "-o", required=True,
                   help="JSONL file of results, one per request line ('-': stdout)")
    p.add_argument("--resume", action="store_true",
                   help="keep the results already in --output and run only the missing ones")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    p.add_argument("--order", choices=["input", "finish"], default="input",
                   help="write results in input order (default; resumable as a prefix) or as "
                        "they finish")
    p.add_argument("--format", choices=["auto", "chat", "responses", "messages"],
                   default="auto", help="format of bare request bodies (default: detected)")
    p.add_argument("--no-thinking", action="store_true",
                   help="requests that do not choose a thinking mode run without thinking")
    p.add_argument("--max-tokens", type=positive_int, default=None,
                   help="token budget of requests that set none (default: up to the context)")
    p.add_argument("--created", type=nonneg_int, default=None,
                   help="one Unix timestamp for every response (reproducible output files)")
    p.add_argument("--speculative", choices=["mtp", "dspark"], default=None,
                   help="speculative decoding (dspark: the model directory's dspark/ drafter "
                        "unless --drafter)")
    p.add_argument("--drafter", default=None, help="DSpark drafter directory")
    p.add_argument("--max-batch", type=positive_int, default=None,
                   help="requests running at once (Engine max_batch; default 16)")
    p.add_argument("--max-len", type=positive_int, default=None,
                   help="context limit per request (default min(4096, the model's))")
    p.add_argument("--max-tokens-per-step", type=positive_int, default=None,
                   help="token budget of one engine step (default 512)")
    p.add_argument("--prefill-chunk", type=positive_int, default=None,
                   help="widest prefill row (default min(256, --max-tokens-per-step))")
    p.add_argument("--window", type=positive_int, default=1024,
                   help="requests per engine call (bounds memory for huge files)")
    p.add_argument("--engine-options", type=_json_object, default={},
                   help='more Engine keyword arguments as a JSON object, e.g. '
                        '\'{"num_pages": 512, "decode_buckets": [4, 16]}\'')
    p.set_defaults(fn=cmd_batch)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if os.environ.get("DEEPINFER_DEBUG", "").strip() not in ("", "0"):
        return args.fn(args)
    try:
        return args.fn(args)
    except UsageError as e:
        _fail(f"{PROG} {args.cmd}: error: {e}", 2)
    except KeyboardInterrupt:
        _fail(f"{PROG} {args.cmd}: interrupted", 130)
    except Exception as e:  # the library's own errors (ValueError, ConfigError, ...) and others
        _fail(f"{PROG} {args.cmd}: error: {type(e).__name__}: {e} (DEEPINFER_DEBUG=1 shows the "
              "traceback)", 1)


if __name__ == "__main__":
    sys.exit(main())
