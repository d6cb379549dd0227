"""The functional generation API: `generate`, `stream_generate`, `generate_programs`.

`generate(params, tokens, lengths=..., max_new_tokens=...)` prefills every prompt (ragged:
row b has lengths[b] real tokens, the rest of the row is ignored) in fixed-size chunks, then
runs one jitted decode loop that samples, feeds each row its own token and stops rows
independently; the decode state is donated, and nothing returns to the host until the end.
A batch of short prompts (padded width <= `plain.LOOP_PREFILL_MAX_TOKENS`) skips the chunked
prefill: the decode loop feeds the prompt tokens one step each, so the call compiles one
model program instead of two. `speculative=` runs the speculative loop of the named drafter
instead, `constraint=` the grammar-masked variant of either.

The pieces live in `deepinfer_fn.decoding`: `output` (GenerateOutput), `checks` (argument
checks), `prefill` (chunked prefill and shape buckets), `plain` (the decode loop),
`constrained` (the grammar-masked loop), `speculative` (the speculative run, one
`speculative.loop.speculative_step` per iteration), `rows` (mesh padding and placement).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_fn import bundle, structured
from deepinfer_fn.api import mesh_context
from deepinfer_fn.compile_cache import Job, precompile
from deepinfer_fn.decoding.checks import (check_bounded_replay, check_options, check_prompts,
                                          check_stop_tokens)
from deepinfer_fn.decoding.constrained import constrained_blocks
from deepinfer_fn.decoding.output import GenerateOutput
from deepinfer_fn.decoding.plain import (LOOP_PREFILL_MAX_TOKENS, decode_block, decode_width,
                                         feeds_last_token, loop_prompt, plain_blocks, stop_array,
                                         uses_loop_prefill)
from deepinfer_fn.decoding.prefill import (bucket, empty_state, prefill, prefill_forward,
                                           prefill_width)
from deepinfer_fn.decoding.rows import mesh_rows, on_mesh
from deepinfer_fn.decoding.speculative import (speculative_output, speculative_pieces,
                                               speculative_run)
from deepinfer_fn.errors import ArgumentTypeError
from deepinfer_fn.params import Params
from deepinfer_fn.sampling import sampling_params
from deepinfer_fn.state import init_state
from deepinfer_fn.validate import positive_int

__all__ = ["generate", "stream_generate", "generate_programs", "GenerateOutput",
           "check_prompts", "check_stop_tokens", "check_options", "prefill", "prefill_width",
           "decode_width", "stop_array", "decode_block", "empty_state"]


def generate(params: Params | bundle.Model, tokens, *, lengths=None, max_new_tokens: int,
             temperature=0.0, top_k=None, top_p=None, min_p=None, seed=0,
             stop_tokens: Sequence[int] = (), return_logprobs: bool = False,
             pad_id: int | None = None, prefill_chunk: int = 512, max_len: int | None = None,
             window_slots: int | None = None, constraint=None, tokenizer=None,
             speculative: str | None = None, num_draft_tokens: int | None = None,
             drafter=None, verify_len: str = "fixed", verify_cost=None,
             decoder_swa_bounded_replay: bool | None = None) -> GenerateOutput:
    """Generates up to `max_new_tokens` per prompt.

    params: `Params`, or a `Model` bundle (`load_model`) whose tokenizer and DSpark drafter are
    the defaults of `tokenizer=` and `drafter=`.

    tokens: int [B, T] right-padded prompts (or one [T] prompt); lengths: [B] real lengths
    (default T). Sampling arguments are scalars or per-row sequences (temperature 0 = greedy);
    a row's randomness depends only on its seed and positions, never on the batch. A row stops
    after emitting any of `stop_tokens`; positions after it hold `pad_id` (default eos).
    Prompts of at most 16 tokens (the padded width) are fed through the decode loop's model
    step instead of a prefill chunk (same tokens up to last-ulp differences between a chunk
    and single-token steps; DEEPINFER_LOOP_PREFILL=off uses the chunked prefill).

    constraint: a `deepinfer_fn.Regex`, `JsonSchema` or `Grammar` for every row, or a list of B
    (None = free row), compiled against `tokenizer` (a `deepinfer_fn.text.Tokenizer`; default:
    the V4 vocabulary). A constrained row may emit the tokenizer's EOS only once its output is a
    complete match, and ends after it; `constraint_status` reports per row "complete",
    "incomplete" (max_new_tokens ran out first) or "error: ..." (that row alone fails, empty).

    speculative="mtp": speculative decoding with the checkpoint's MTP block drafting
    `num_draft_tokens` (k, default 3) tokens per step, all verified by one k+1-token
    forward. Lossless: greedy rows give exactly the tokens of plain greedy decoding (up to the
    last-ulp differences between a k+1-token chunk and single-token steps), sampled rows the same
    distribution as the plain sampler (not the same draws: the keys are per verify step,
    docs/MODEL.md §D5.2). The output carries per-step acceptance counts (`accepted`,
    `verified`, `acceptance()`). With `constraint`, the drafts are drawn under the grammar
    masks and verified against the masked target (still lossless: greedy constrained rows give
    the tokens of plain greedy constrained decoding). On a sharded mesh as plain decoding
    (batch over dp x ep, padded; experts over ep). verify_len="random" (a uniform verify
    length per row and step) works as for "dspark"; "dynamic" needs a confidence head.

    speculative="dspark": the DSpark drafter `drafter` (a `deepinfer_fn.speculative.DSpark`,
    e.g. `load_dspark(default_dspark_path(), params)` for the embedded default model) drafts
    its block of γ tokens per step (num_draft_tokens, if given, must equal γ); each row
    verifies ell of them: verify_len="fixed" -> ell = γ (deterministic with a fixed seed),
    "dynamic" -> ell per row from the confidence head and `verify_cost` (a
    `speculative.schedule.VerifyCost` profile; docs/MODEL.md §D3), "random" -> uniform in
    0..γ per row and step (a diagnostic for losslessness tests). With verify_len="fixed",
    `verify_cost` is optional: given, the run uses the same compiled program as "dynamic" with
    that profile (the verifying-everything choice is a traced flag), so comparing the two
    compiles once; the tokens are those of "fixed" without it. Same losslessness and
    statistics as "mtp"; the output also carries the confidence logits (`draft_confidence`).
    With `constraint`, the Markov pass draws each draft under the grammar mask after the
    drafts before it and the target is verified masked, as for "mtp" (greedy constrained
    rows give the tokens of plain greedy constrained decoding). On a sharded mesh as "mtp";
    the drafter is replicated on every device, and a dynamic verify length reads `verify_cost`
    at the rows per device.

    Any other name registered in `deepinfer_fn.speculative.registry` runs its drafter through
    the same step (`speculative.loop.speculative_step`), with `drafter=` its weights.

    decoder_swa_bounded_replay (DeepSeek-V4.1, docs/MODEL.md §V3-V4): None (default) = on for
    V4.1 models, off for V4; True on a V4 model raises ArgumentError. On, every prefill chunk
    runs the late layers (from the last kv source on) on its last sliding_window rows only,
    their window floored there (`model.replay_v41.extend`); decode steps and speculative verify
    chunks run every row. The speculative prefill does the same, the drafter's context taken
    from the tail rows' features. Off: every layer on every row (the exact prefill).
    """
    params, drafter, tokenizer = bundle.unpack(params, speculative=speculative, drafter=drafter,
                                               tokenizer=tokenizer, where="generate")
    cfg = params.config
    tokens, lengths = check_prompts(tokens, lengths, cfg, max_new_tokens, max_len)
    stop_tokens = check_stop_tokens(stop_tokens, cfg)
    check_options(cfg, tokens.shape[0], where="generate", temperature=temperature, top_k=top_k,
                  top_p=top_p, min_p=min_p, seed=seed, pad_id=pad_id,
                  prefill_chunk=prefill_chunk, window_slots=window_slots,
                  return_logprobs=return_logprobs, speculative=speculative,
                  num_draft_tokens=num_draft_tokens, verify_len=verify_len)
    bounded_replay = check_bounded_replay(cfg, decoder_swa_bounded_replay)
    if speculative is not None:
        runs = speculative_run(
            params, tokens, lengths, method=speculative, k=num_draft_tokens,
            drafter=drafter, verify_len=verify_len, verify_cost=verify_cost,
            max_new_tokens=int(max_new_tokens), block=int(max_new_tokens),
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
            stop_tokens=stop_tokens, pad_id=pad_id, prefill_chunk=prefill_chunk,
            max_len=max_len, window_slots=window_slots, constraint=constraint,
            tokenizer=tokenizer, bounded_replay=bounded_replay)
        return speculative_output(runs, max_new_tokens=int(max_new_tokens),
                                  return_logprobs=return_logprobs)
    return _generate_blocks(params, tokens, lengths, max_new_tokens=int(max_new_tokens),
                            block=int(max_new_tokens), temperature=temperature, top_k=top_k,
                            top_p=top_p, min_p=min_p, seed=seed, stop_tokens=stop_tokens,
                            return_logprobs=return_logprobs, pad_id=pad_id,
                            prefill_chunk=prefill_chunk, max_len=max_len,
                            window_slots=window_slots, constraint=constraint,
                            tokenizer=tokenizer, bounded_replay=bounded_replay).__next__()



def stream_generate(params: Params | bundle.Model, tokens, *, block: int = 8, **kwargs):
    """Like `generate`, but yields a `GenerateOutput` of up to `block` new tokens per row at a
    time (the device runs `block` decode steps per call; Python sees one transfer per block).
    The last output of each row is padded after it stops.

    With speculative=: each output holds the tokens each row committed since the previous one
    (`lengths` counts them); after the i-th output a running row has between i x block and
    i x block + the draft length tokens (a verify step commits several). A row that reaches
    the block's end waits for the others without taking steps, so its tokens, keys and
    acceptance are those of `generate` (with verify_len="dynamic" the scheduler decides over
    the rows stepping, so verify lengths can differ; the output distribution cannot).
    `accepted` / `verified` / `draft_confidence` are the histories so far (-1 / 0 for steps
    not run yet)."""
    params, drafter, tokenizer = bundle.unpack(
        params, speculative=kwargs.get("speculative"), drafter=kwargs.get("drafter"),
        tokenizer=kwargs.get("tokenizer"), where="stream_generate")
    for key, value in (("drafter", drafter), ("tokenizer", tokenizer)):
        if value is not None:
            kwargs[key] = value
    speculative = {key: kwargs.pop(key) for key in ("speculative", "num_draft_tokens",
                                                    "drafter", "verify_len", "verify_cost")
                   if key in kwargs}
    if "max_new_tokens" not in kwargs:
        raise ArgumentTypeError("stream_generate: missing the keyword argument max_new_tokens")
    max_new_tokens = kwargs.pop("max_new_tokens")
    lengths = kwargs.pop("lengths", None)
    bounded_replay = kwargs.pop("decoder_swa_bounded_replay", None)
    _with_defaults(kwargs)  # unknown keywords fail here, at the call
    tokens, lengths = check_prompts(tokens, lengths, params.config, max_new_tokens,
                                    kwargs.get("max_len"), where="stream_generate")
    kwargs["stop_tokens"] = check_stop_tokens(kwargs.get("stop_tokens", ()), params.config,
                                              where="stream_generate")
    options = {k: kwargs[k] for k in ("temperature", "top_k", "top_p", "min_p", "seed", "pad_id",
                                      "prefill_chunk", "window_slots", "return_logprobs")
               if k in kwargs}
    check_options(params.config, tokens.shape[0], where="stream_generate",
                  speculative=speculative.get("speculative"),
                  num_draft_tokens=speculative.get("num_draft_tokens"),
                  verify_len=speculative.get("verify_len", "fixed"), **options)
    block = positive_int("stream_generate", "block", block)
    max_new_tokens = int(max_new_tokens)
    bounded_replay = check_bounded_replay(params.config, bounded_replay, where="stream_generate")

    def blocks():
        if speculative.get("speculative") is not None:
            return_logprobs = kwargs.pop("return_logprobs", False)
            runs = speculative_run(
                params, tokens, lengths, method=speculative["speculative"],
                k=speculative.get("num_draft_tokens"), drafter=speculative.get("drafter"),
                verify_len=speculative.get("verify_len", "fixed"),
                verify_cost=speculative.get("verify_cost"), max_new_tokens=max_new_tokens,
                block=block, bounded_replay=bounded_replay, **_with_defaults(kwargs))
            pad = params.config.eos_token_id if kwargs.get("pad_id") is None else kwargs["pad_id"]
            yield from speculative_pieces(runs, pad_id=pad, return_logprobs=return_logprobs)
            return
        yield from _generate_blocks(params, tokens, lengths, max_new_tokens=max_new_tokens,
                                    block=block, bounded_replay=bounded_replay, **kwargs)
    return blocks()


def _with_defaults(kwargs: dict) -> dict:
    """generate's keyword defaults for the arguments `speculative_run` needs explicitly."""
    out = dict(temperature=0.0, top_k=None, top_p=None, min_p=None, seed=0, stop_tokens=(),
               pad_id=None, prefill_chunk=512, max_len=None, window_slots=None, constraint=None,
               tokenizer=None)
    unknown = set(kwargs) - set(out) - {"return_logprobs"}
    if unknown:
        raise ArgumentTypeError(f"stream_generate got unexpected keyword arguments "
                                f"{sorted(unknown)}")
    out.update(kwargs)
    return out



def _generate_blocks(params, tokens, lengths, *, max_new_tokens, block, temperature=0.0,
                     top_k=None, top_p=None, min_p=None, seed=0, stop_tokens=(),
                     return_logprobs=False, pad_id=None, prefill_chunk=512, max_len=None,
                     window_slots=None, constraint=None, tokenizer=None, bounded_replay=False):
    """The plain (or constrained) run of `generate` / `stream_generate`: outputs of up to
    `block` tokens per row (`generate`: one block of max_new_tokens); bounded_replay: the
    resolved decoder_swa_bounded_replay."""
    cfg = params.config
    B = tokens.shape[0]
    constrained = None
    if constraint is not None:  # compiled per request on the host; a bad grammar fails its row
        constrained = structured.ConstrainedBatch.build(
            constraint, B, bundle.constraint_tokenizer(params, tokenizer),
            cfg.vocab_size)
    mesh, tokens, lengths, sampling = mesh_rows(params, tokens, lengths, temperature, top_k,
                                                top_p, min_p, seed)
    Bp = tokens.shape[0]
    need = int(lengths.max()) + max_new_tokens
    capacity = max_len or min(bucket(need), cfg.max_position_embeddings)
    if mesh is None:  # compile the call's programs in parallel threads first
        precompile(generate_programs(
            params, Bp, tokens.shape[1], max_new_tokens, block=block,
            prefill_chunk=prefill_chunk, max_len=capacity, window_slots=window_slots,
            num_stop_tokens=len(stop_tokens), constrained=constrained is not None,
            decoder_swa_bounded_replay=bounded_replay))
    state = on_mesh(empty_state(cfg, Bp, capacity, window_slots=window_slots,
                                dtype=params.dtype), mesh)
    pad = jax.device_put(np.int32(cfg.eos_token_id if pad_id is None else pad_id))
    done = jax.device_put(np.arange(Bp) >= B)  # mesh padding rows never decode
    stops = stop_array(stop_tokens)
    width = decode_width(max_new_tokens, block)
    prompt = None
    if uses_loop_prefill(tokens.shape[1], sharded=mesh is not None,
                         constrained=constrained is not None, bounded_replay=bounded_replay):
        prompt = loop_prompt(tokens, lengths)  # the decode loop feeds them: no prefill program
        logits = jax.device_put(np.zeros((Bp, cfg.vocab_size), np.float32))
    else:
        with mesh_context(params)[1]:
            logits, state = prefill(params, state, tokens, lengths, prefill_chunk,
                                    bounded_replay=bounded_replay)
    if constrained is not None:
        yield from constrained_blocks(params, state, logits, done, sampling, pad, constrained,
                                      B=B, max_new_tokens=max_new_tokens, block=block,
                                      stops=stops, width=width,
                                      return_logprobs=return_logprobs)
        return
    yield from plain_blocks(params, state, logits, done, sampling, pad, B=B,
                            max_new_tokens=max_new_tokens, block=block, stops=stops,
                            width=width, return_logprobs=return_logprobs, prompt=prompt)


def generate_programs(params: Params, batch: int, prompt_len: int, max_new_tokens: int, *,
                      block: int | None = None, prefill_chunk: int = 512,
                      max_len: int | None = None, window_slots: int | None = None,
                      num_stop_tokens: int = 1, constrained: bool = False,
                      decoder_swa_bounded_replay: bool | None = None) -> list[Job]:
    """The programs a single-device `generate` (block None) or `stream_generate(block=)` call
    with these shapes runs, as `compile_cache.Job`s: the empty state, the prefill chunk, and
    the decode loop (`feeds_last_token`); prompts of at most `LOOP_PREFILL_MAX_TOKENS` tokens
    have no prefill program (the decode loop feeds them, `plain.uses_loop_prefill`).
    `precompile(generate_programs(...))` compiles them in parallel; JAX's in-memory and persistent caches then serve the real call.
    decoder_swa_bounded_replay: as `generate` (None: on for V4.1), picks the prefill program."""
    cfg = params.config
    bounded_replay = check_bounded_replay(cfg, decoder_swa_bounded_replay,
                                          where="generate_programs")
    block = max_new_tokens if block is None else max(1, int(block))
    capacity = max_len or min(bucket(prompt_len + max_new_tokens), cfg.max_position_embeddings)
    sd = jax.ShapeDtypeStruct
    i32 = lambda *shape: sd(shape, jnp.int32)
    state = jax.eval_shape(lambda: init_state(cfg, batch, capacity, window_slots=window_slots,
                                              dtype=params.dtype))
    sampling = jax.eval_shape(lambda: sampling_params(batch))
    logits, done = sd((batch, cfg.vocab_size), jnp.float32), sd((batch,), jnp.bool_)
    stops = sd(stop_array((0,) * num_stop_tokens).shape, jnp.int32)
    masks = ((sd((batch, structured.mask_words(cfg.vocab_size)), jnp.uint32), i32())
             if constrained else ())
    width = decode_width(max_new_tokens, block)
    jobs = [Job(empty_state, (cfg, batch, capacity), dict(window_slots=window_slots,
                                                           dtype=params.dtype))]
    loop = dict(n=width, stops=stops, limit=i32(),
                feed_last=feeds_last_token(max_new_tokens, block))
    if uses_loop_prefill(prompt_len, constrained=constrained, bounded_replay=bounded_replay):
        loop["prompt"] = (i32(batch, LOOP_PREFILL_MAX_TOKENS), i32(batch))
    else:
        jobs.append(Job(prefill_forward, (params, state,
                                          i32(batch, prefill_width(prompt_len, prefill_chunk)),
                                          i32(batch)), dict(bounded_replay=bounded_replay)))
    jobs.append(Job(decode_block, (params, state, logits, done, sampling, i32()) + masks, loop))
    return jobs

