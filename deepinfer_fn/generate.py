"""The functional generation API: chunked prefill, then one jitted decode loop (DESIGN.md).

`generate(params, tokens, lengths=..., max_new_tokens=...)` prefills every prompt (ragged:
row b has lengths[b] real tokens, the rest of the row is ignored) in fixed-size chunks, then
runs a `lax.while_loop` that samples, feeds each row its own token and stops rows
independently; the decode state is donated, and nothing returns to the host until the end.

`generate(..., speculative="mtp", num_draft_tokens=k)` takes a separate path
(`_speculative_run`): the same prefill (plus the MTP drafter's), then a while-loop whose
step drafts k tokens with the MTP block, verifies them with one k+1-token `forward_chunk`,
accepts per row (deepinfer_fn/speculative/verify.py), rolls the state back to the accepted
prefix and feeds the MTP the accepted positions. With a constraint, the drafts and the verified
target distributions are masked by the grammar state at every draft position and the matchers
roll back with the state (deepinfer_fn/structured.py, "Speculative decoding"); the DSpark path
(`_dspark_run`) does the same inside its Markov draft pass. A speculative run is a start
(first token, loop carry) and segments of that while-loop, each running the rows short of a
token target (`_run_segments`): `generate` runs one segment to the end, `stream_generate` one
per block.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from deepinfer_fn.compile_cache import Job, precompile
from deepinfer_fn.errors import ArgumentError, ArgumentTypeError
from deepinfer_fn.validate import boolean, describe, is_int, one_of, positive_int, token_id
from deepinfer_fn.model import transformer
from deepinfer_fn.params import Params
from deepinfer_fn.sampling import (Role, SamplingParams, check_sampling, request_key, sample,
                                   sampling_params)
from deepinfer_fn.state import DecodeState, init_state
from deepinfer_fn import speculative as spec
from deepinfer_fn import structured


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """tokens int32 [B, N] (pad_id after a row stops); lengths int32 [B] generated tokens
    (a stop token included); logprobs float32 [B, N] or None; stopped bool [B] (True when a
    stop token ended the row, False when max_new_tokens did). constraint_status: None for an
    unconstrained call, else per row None (free row), "complete" (the output fully matches its
    constraint), "incomplete" (max_new_tokens ran out first: only a prefix), "pending" (a
    stream block with the row still running) or "error: <message>" (bad grammar/schema: the
    row produced nothing).

    Speculative decoding only (else None): accepted int32 [B, N], per verify step of each row
    the number of accepted draft tokens g (the step emitted g + 1 tokens), -1 after the row's
    last step; verified int32 [B, N] the number of drafts verified in that step (k, fewer
    near max_new_tokens), -1 likewise. `acceptance()` summarises them. DSpark only:
    draft_confidence float32 [B, N, γ], the drafter's confidence logits of each step's γ
    slots (uncalibrated; rows as in `accepted`), the log STS calibration reads (spec §1.5)."""

    tokens: jax.Array
    lengths: jax.Array
    stopped: jax.Array
    logprobs: jax.Array | None = None
    constraint_status: tuple[str | None, ...] | None = dataclasses.field(
        default=None, metadata=dict(static=True))
    accepted: jax.Array | None = None
    verified: jax.Array | None = None
    draft_confidence: jax.Array | None = None

    def finish_reasons(self) -> list[str]:
        status = self.constraint_status or (None,) * len(self.stopped)
        return ["error" if st is not None and st.startswith("error") else "stop" if s else "length"
                for s, st in zip(np.asarray(self.stopped), status)]

    def acceptance(self) -> dict[str, float]:
        """Speculative statistics over all rows and steps (spec/dspark.md §4.1): steps;
        mean_accepted = mean g per step; tau = mean tokens committed per step including the
        correction/bonus token (mean g + 1, before truncation at a stop token or at
        max_new_tokens); acceptance_rate = sum g / sum drafts verified."""
        if self.accepted is None:
            raise ValueError("acceptance() needs an output of generate(..., speculative=...)")
        acc, ver = np.asarray(self.accepted), np.asarray(self.verified)
        live = acc >= 0
        steps = int(live.sum())
        g, v = acc[live].astype(np.float64), ver[live].astype(np.float64)
        return dict(steps=steps, mean_accepted=float(g.mean()) if steps else float("nan"),
                    tau=float(g.mean() + 1) if steps else float("nan"),
                    acceptance_rate=float(g.sum() / v.sum()) if v.sum() else float("nan"))


# An empty decode state in one program (eagerly, each array would compile its own).
empty_state = jax.jit(init_state, static_argnums=(0, 1, 2), static_argnames=("window_slots", "dtype"))


def _bucket(n: int, minimum: int = 256) -> int:
    """Round a capacity up to a power of two so repeated calls reuse compiled programs."""
    return max(minimum, 1 << (int(n) - 1).bit_length())


@functools.partial(jax.jit, donate_argnums=(1,))
def _prefill_chunk(params, state, chunk, n_new):
    logits, state, _ = transformer.forward_chunk(params, state, chunk, n_new)
    return logits, state


@functools.partial(jax.jit, static_argnames=("n", "feed_last"), donate_argnums=(1,))
def _decode_block(params: Params, state: DecodeState, logits, done, sampling: SamplingParams,
                  pad_id, masks=None, session=None, *, n: int, stops, limit=None,
                  feed_last: bool):
    """Samples up to `limit` (traced int32, <= n; default n) tokens per row inside one
    `lax.while_loop`, feeding each row its own token (rows that stopped feed nothing and keep
    their state). n (static) is the output width: one compiled program serves every
    limit <= n. stops: int32 [S] stop tokens (-1 = none; `stop_array`). Returns
    (tokens [B,n], logprobs [B,n], counts [B], state, next logits [B,V], done [B]);
    with feed_last=False the limit-th token is not fed (no wasted model step at the end).

    Constrained (masks: packed allowed-token bits uint32 [B, ceil(V/32)] for the first step;
    session: int32 id of a registered `structured.ConstrainedBatch`): each step samples under
    the unpacked masks, then one io_callback hands the sampled tokens to the host, which
    advances the matchers and returns the next step's masks and the rows whose constraint
    finished (they stop). The last masks come back as a 7th output, for the next block.
    """
    B = logits.shape[0]
    limit = jnp.int32(n) if limit is None else jnp.minimum(limit, n)
    constrained = masks is not None

    def cond(loop):
        i, done = loop[0], loop[6]
        return (i < limit) & ~jnp.all(done)

    def body(loop):
        i, state, logits, out, logp, count, done = loop[:7]
        allowed = structured.unpack_bitmask(loop[7], logits.shape[-1]) if constrained else None
        token, lp = sample(logits, sampling, state.lengths, allowed)
        token = jnp.where(done, pad_id, token)
        out = out.at[:, i].set(token)
        logp = logp.at[:, i].set(jnp.where(done, 0.0, lp))
        count = count + (~done).astype(jnp.int32)
        feed = (~done).astype(jnp.int32)
        active = ~done
        done = done | jnp.isin(token, stops)
        extra = ()
        if constrained:  # the host consumes the tokens and packs the next step's masks
            next_masks, finished = io_callback(
                structured.host_step, (jax.ShapeDtypeStruct(loop[7].shape, jnp.uint32),
                                       jax.ShapeDtypeStruct((B,), jnp.bool_)),
                session, token, active, ordered=False)
            done = done | finished
            extra = (next_masks,)

        def step(args):
            state, logits = args
            logits, state, _ = transformer.forward_chunk(params, state, token[:, None], feed)
            return state, logits

        if feed_last:
            state, logits = step((state, logits))
        else:
            state, logits = jax.lax.cond(i + 1 < limit, step, lambda a: a, (state, logits))
        return (i + 1, state, logits, out, logp, count, done) + extra

    init = (jnp.int32(0), state, logits, jnp.full((B, n), pad_id, jnp.int32),
            jnp.zeros((B, n), jnp.float32), jnp.zeros((B,), jnp.int32), done)
    init += (masks,) if constrained else ()
    _, state, logits, out, logp, count, done, *rest = jax.lax.while_loop(cond, body, init)
    return (out, logp, count, state, logits, done, *rest)


def check_prompts(tokens, lengths, cfg, max_new_tokens: int, max_len: int | None,
                  where: str = "generate"):
    """Host-side validation of a prompt batch; returns (tokens int32 [B,T], lengths int32 [B])."""
    try:
        arr = np.asarray(tokens)
    except ValueError as e:
        raise ArgumentError(f"{where}: tokens must be a rectangular [batch, length] array of "
                            f"token ids (right-pad ragged prompts and pass lengths=): {e}") from None
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2:
        raise ArgumentError(f"tokens must be [batch, length], got shape {arr.shape}")
    if arr.size == 0:
        raise ArgumentError(f"empty prompt batch (tokens shape {arr.shape})")
    if arr.dtype.kind not in "iu":
        raise ArgumentTypeError(f"tokens must hold integer token ids, got dtype {arr.dtype}")
    B, T = arr.shape
    if lengths is None:
        lens = np.full((B,), T, np.int64)
    else:
        try:
            lens = np.asarray(lengths)
        except ValueError as e:
            raise ArgumentError(f"{where}: lengths must be a [batch] int array: {e}") from None
        if lens.dtype.kind not in "iu":
            raise ArgumentTypeError(f"{where}: lengths must hold ints (real prompt lengths), got "
                                    f"{describe(lengths)} with dtype {lens.dtype}")
        lens = lens.astype(np.int64)
    if lens.shape != (B,):
        raise ArgumentError(f"lengths has shape {lens.shape}, expected ({B},) for {B} prompts")
    if np.any(lens < 1):
        raise ArgumentError(f"empty prompt(s): rows {np.flatnonzero(lens < 1).tolist()} have length < 1")
    if np.any(lens > T):
        raise ArgumentError(f"lengths {lens.tolist()} exceed the token array width {T}")
    real = np.arange(T)[None] < lens[:, None]
    bad = real & ((arr < 0) | (arr >= cfg.vocab_size))
    if bad.any():
        row, col = np.argwhere(bad)[0]
        raise ArgumentError(f"token id {int(arr[row, col])} at row {row}, position {col} is outside "
                            f"the vocabulary [0, {cfg.vocab_size})")
    max_new_tokens = positive_int(where, "max_new_tokens", max_new_tokens)
    if max_len is not None:
        max_len = positive_int(where, "max_len", max_len)
    limit = cfg.max_position_embeddings if max_len is None else min(max_len, cfg.max_position_embeddings)
    over = lens + max_new_tokens > limit
    if over.any():
        r = int(np.flatnonzero(over)[0])
        raise ArgumentError(f"prompt {r} ({int(lens[r])} tokens) + max_new_tokens {max_new_tokens} "
                            f"exceeds the context limit of {limit} tokens")
    return np.where(real, arr, 0).astype(np.int32), lens.astype(np.int32)


def check_stop_tokens(stop_tokens, cfg, where: str = "generate") -> tuple[int, ...]:
    """stop_tokens as a tuple of ids in [0, vocab) (ints, not bools or floats)."""
    if isinstance(stop_tokens, (str, bytes)) or is_int(stop_tokens):
        raise ArgumentTypeError(f"{where}: stop_tokens must be a sequence of token ids, got "
                                f"{describe(stop_tokens)} (for one id write [id])")
    try:
        items = np.asarray(stop_tokens).reshape(-1).tolist() if hasattr(stop_tokens, "shape") \
            else list(stop_tokens)
    except TypeError:
        raise ArgumentTypeError(f"{where}: stop_tokens must be a sequence of token ids, got "
                                f"{describe(stop_tokens)}") from None
    wrong = [t for t in items if not is_int(t)]
    if wrong:
        raise ArgumentTypeError(f"{where}: stop_tokens must hold int token ids, got "
                                f"{describe(wrong[0])} in {items!r}")
    stop_tokens = tuple(int(t) for t in items)
    bad = [t for t in stop_tokens if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ArgumentError(f"stop_tokens {bad} are outside the vocabulary [0, {cfg.vocab_size})")
    return stop_tokens


def check_options(cfg, batch: int, *, where: str, temperature=0.0, top_k=None, top_p=None,
                  min_p=None, seed=0, pad_id=None, prefill_chunk=512, window_slots=None,
                  return_logprobs=False, speculative=None, num_draft_tokens=None,
                  verify_len="fixed") -> None:
    """Host-side checks of generate's remaining keyword arguments (nothing is traced)."""
    check_sampling(batch, temperature, top_k, top_p, min_p, seed)
    if pad_id is not None:
        token_id(where, "pad_id", pad_id, cfg.vocab_size)
    positive_int(where, "prefill_chunk", prefill_chunk)
    if window_slots is not None:
        positive_int(where, "window_slots", window_slots)
    boolean(where, "return_logprobs", return_logprobs)
    if speculative is not None:
        one_of(where, "speculative", speculative, ("mtp", "dspark"))
    if num_draft_tokens is not None:
        positive_int(where, "num_draft_tokens", num_draft_tokens)
    one_of(where, "verify_len", verify_len, ("fixed", "dynamic", "random"))


def _prefill_chunks(tokens: np.ndarray, lengths: np.ndarray, chunk: int):
    """Chunked prefill of right-padded prompts tokens [B,T]: yields (ids int32 [B,c] on the
    device, next ids [B,c] numpy (the tokens one position later, padding past T), n_new [B],
    ends_here bool [B] numpy (the row's prompt ends in this chunk)) while some row still has
    tokens. The chunk width c is `prefill_width(T, chunk)`."""
    T = tokens.shape[1]
    chunk = prefill_width(T, chunk)
    padded = -(-T // chunk) * chunk
    tokens = np.pad(tokens, ((0, 0), (0, padded + 1 - T)))
    for off in range(0, padded, chunk):
        n_new = np.clip(lengths - off, 0, chunk).astype(np.int32)
        if not n_new.any():
            return
        yield (jax.device_put(tokens[:, off:off + chunk]), tokens[:, off + 1:off + chunk + 1], n_new,
               (lengths > off) & (lengths <= off + chunk))


def prefill_width(prompt_len: int, chunk: int) -> int:
    """Width of generate's prefill chunks: the prompt length rounded up to a power of two
    (at least 16), capped at `chunk`, so prompts of similar lengths share one program."""
    return max(1, min(int(chunk), _bucket(prompt_len, 16)))


def decode_width(max_new_tokens: int, block: int) -> int:
    """Output width of generate's decode program: `block` when streaming in blocks, else
    max_new_tokens rounded up to a power of two (at least 16); the loop runs a traced limit."""
    if block < max_new_tokens:
        return int(block)
    return _bucket(max_new_tokens, 16)


def stop_array(stop_tokens: Sequence[int]) -> jax.Array:
    """Stop tokens as int32 [S], padded with -1 to a power of two (at least 4): the decode
    program takes them as data, so changing them compiles nothing."""
    stop_tokens = tuple(stop_tokens)
    width = _bucket(max(len(stop_tokens), 1), 4)
    return jax.device_put(np.asarray(stop_tokens + (-1,) * (width - len(stop_tokens)), np.int32))


def _keep_last(prev, new, ends_here):
    """Per row, `new` where the row's prompt ends in this chunk, else `prev` (pytrees of
    arrays [B, ...]; prev None: the first chunk)."""
    if prev is None:
        return new
    ends_here = jnp.asarray(ends_here)
    pick = lambda n, p: jnp.where(ends_here.reshape((-1,) + (1,) * (n.ndim - 1)), n, p)
    return jax.tree.map(pick, new, prev)


def prefill(params: Params, state: DecodeState, tokens: np.ndarray, lengths: np.ndarray,
            chunk: int):
    """Chunked prefill of right-padded prompts; returns (last-token logits [B,V], state)."""
    last = None
    for ids, _, n_new, ends_here in _prefill_chunks(tokens, lengths, chunk):
        logits, state = _prefill_chunk(params, state, ids, jax.device_put(n_new))
        last = _keep_last(last, logits, ends_here)
    return last, state


def generate(params: Params, tokens, *, lengths=None, max_new_tokens: int,
             temperature=0.0, top_k=None, top_p=None, min_p=None, seed=0,
             stop_tokens: Sequence[int] = (), return_logprobs: bool = False,
             pad_id: int | None = None, prefill_chunk: int = 512, max_len: int | None = None,
             window_slots: int | None = None, constraint=None, tokenizer=None,
             speculative: str | None = None, num_draft_tokens: int | None = None,
             drafter=None, verify_len: str = "fixed", verify_cost=None) -> GenerateOutput:
    """Generates up to `max_new_tokens` per prompt.

    tokens: int [B, T] right-padded prompts (or one [T] prompt); lengths: [B] real lengths
    (default T). Sampling arguments are scalars or per-row sequences (temperature 0 = greedy);
    a row's randomness depends only on its seed and positions, never on the batch. A row stops
    after emitting any of `stop_tokens`; positions after it hold `pad_id` (default eos).

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
    spec/dspark.md §5.2). The output carries per-step acceptance counts (`accepted`,
    `verified`, `acceptance()`). With `constraint`, the drafts are drawn under the grammar
    masks and verified against the masked target (still lossless: greedy constrained rows give
    the tokens of plain greedy constrained decoding). On a sharded mesh as plain decoding
    (batch over dp x ep, padded; experts over ep).

    speculative="dspark": the DSpark drafter `drafter` (a `deepinfer_fn.speculative.DSpark`,
    e.g. `load_dspark(default_dspark_path(), params)` for the embedded default model) drafts
    its block of γ tokens per step (num_draft_tokens, if given, must equal γ); each row
    verifies ell of them: verify_len="fixed" -> ell = γ (deterministic with a fixed seed),
    "dynamic" -> ell per row from the confidence head and `verify_cost` (a
    `speculative.schedule.VerifyCost` profile; spec/dspark.md §3), "random" -> uniform in
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
    """
    if not isinstance(params, Params):
        raise ArgumentTypeError(f"params must be deepinfer_fn.Params, got {type(params).__name__}")
    cfg = params.config
    tokens, lengths = check_prompts(tokens, lengths, cfg, max_new_tokens, max_len)
    stop_tokens = check_stop_tokens(stop_tokens, cfg)
    check_options(cfg, tokens.shape[0], where="generate", temperature=temperature, top_k=top_k,
                  top_p=top_p, min_p=min_p, seed=seed, pad_id=pad_id,
                  prefill_chunk=prefill_chunk, window_slots=window_slots,
                  return_logprobs=return_logprobs, speculative=speculative,
                  num_draft_tokens=num_draft_tokens, verify_len=verify_len)
    if speculative is not None:
        return _speculative_generate(
            params, tokens, lengths, method=speculative, k=num_draft_tokens,
            drafter=drafter, verify_len=verify_len, verify_cost=verify_cost,
            max_new_tokens=int(max_new_tokens), temperature=temperature, top_k=top_k,
            top_p=top_p, min_p=min_p, seed=seed, stop_tokens=stop_tokens,
            return_logprobs=return_logprobs, pad_id=pad_id, prefill_chunk=prefill_chunk,
            max_len=max_len, window_slots=window_slots, constraint=constraint,
            tokenizer=tokenizer)
    return _generate_blocks(params, tokens, lengths, max_new_tokens=int(max_new_tokens),
                            block=int(max_new_tokens), temperature=temperature, top_k=top_k,
                            top_p=top_p, min_p=min_p, seed=seed, stop_tokens=stop_tokens,
                            return_logprobs=return_logprobs, pad_id=pad_id,
                            prefill_chunk=prefill_chunk, max_len=max_len,
                            window_slots=window_slots, constraint=constraint,
                            tokenizer=tokenizer).__next__()


def stream_generate(params: Params, tokens, *, block: int = 8, **kwargs):
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
    if not isinstance(params, Params):
        raise ArgumentTypeError(f"params must be deepinfer_fn.Params, got {type(params).__name__}")
    speculative = {key: kwargs.pop(key) for key in ("speculative", "num_draft_tokens",
                                                    "drafter", "verify_len", "verify_cost")
                   if key in kwargs}
    if "max_new_tokens" not in kwargs:
        raise ArgumentTypeError("stream_generate: missing the keyword argument max_new_tokens")
    max_new_tokens = kwargs.pop("max_new_tokens")
    lengths = kwargs.pop("lengths", None)
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

    def blocks():
        if speculative.get("speculative") is not None:
            return_logprobs = kwargs.pop("return_logprobs", False)
            runs = _speculative_run(
                params, tokens, lengths, method=speculative["speculative"],
                k=speculative.get("num_draft_tokens"), drafter=speculative.get("drafter"),
                verify_len=speculative.get("verify_len", "fixed"),
                verify_cost=speculative.get("verify_cost"), max_new_tokens=max_new_tokens,
                block=block, **_with_defaults(kwargs))
            pad = params.config.eos_token_id if kwargs.get("pad_id") is None else kwargs["pad_id"]
            yield from _speculative_pieces(runs, pad_id=pad, return_logprobs=return_logprobs)
            return
        yield from _generate_blocks(params, tokens, lengths, max_new_tokens=max_new_tokens,
                                    block=block, **kwargs)
    return blocks()


def _with_defaults(kwargs: dict) -> dict:
    """generate's keyword defaults for the arguments `_speculative_run` needs explicitly."""
    out = dict(temperature=0.0, top_k=None, top_p=None, min_p=None, seed=0, stop_tokens=(),
               pad_id=None, prefill_chunk=512, max_len=None, window_slots=None, constraint=None,
               tokenizer=None)
    unknown = set(kwargs) - set(out) - {"return_logprobs"}
    if unknown:
        raise ArgumentTypeError(f"stream_generate got unexpected keyword arguments "
                                f"{sorted(unknown)}")
    out.update(kwargs)
    return out


def _mesh_rows(params, tokens, lengths, temperature, top_k, top_p, min_p, seed):
    """(mesh or None, tokens [Bp, T], lengths [Bp], SamplingParams [Bp]). On a sharded mesh the
    batch is padded to a multiple of the mesh's batch shards with 1-token dummy rows (sampling
    arguments copied from row 0); callers mark rows >= B done and slice them off."""
    from deepinfer_fn.api import mesh_context, pad_batch
    mesh, _ = mesh_context(params)
    if mesh is not None:
        from shardings.mesh import batch_shards
        shards = batch_shards(mesh)
        tokens, lengths = pad_batch(tokens, shards), pad_batch(lengths, shards, fill=1)
        per_row = lambda v: (v if v is None or np.ndim(v) == 0
                             else pad_batch(np.asarray(v), shards, np.asarray(v)[0]))
        temperature, top_k, top_p, min_p, seed = map(per_row, (temperature, top_k, top_p, min_p,
                                                               seed))
    sampling = sampling_params(tokens.shape[0], temperature, top_k, top_p, min_p, seed)
    return mesh, tokens, lengths, sampling


def _on_mesh(state, mesh):
    """A decode state (target's, MTP's or DSpark's) split over the mesh's batch axes."""
    if mesh is None:
        return state
    from shardings.mesh import state_shardings
    return jax.device_put(state, state_shardings(state, mesh))


def _generate_blocks(params, tokens, lengths, *, max_new_tokens, block, temperature=0.0,
                     top_k=None, top_p=None, min_p=None, seed=0, stop_tokens=(),
                     return_logprobs=False, pad_id=None, prefill_chunk=512, max_len=None,
                     window_slots=None, constraint=None, tokenizer=None):
    from deepinfer_fn.api import mesh_context
    cfg = params.config
    B = tokens.shape[0]
    constrained = None
    if constraint is not None:  # compiled per request on the host; a bad grammar fails its row
        constrained = structured.ConstrainedBatch.build(
            constraint, B, structured.default_tokenizer() if tokenizer is None else tokenizer,
            cfg.vocab_size)
    mesh, tokens, lengths, sampling = _mesh_rows(params, tokens, lengths, temperature, top_k,
                                                 top_p, min_p, seed)
    Bp = tokens.shape[0]
    need = int(lengths.max()) + max_new_tokens
    capacity = max_len or min(_bucket(need), cfg.max_position_embeddings)
    if mesh is None:  # compile the call's programs in parallel threads first
        precompile(generate_programs(
            params, Bp, tokens.shape[1], max_new_tokens, block=block,
            prefill_chunk=prefill_chunk, max_len=capacity, window_slots=window_slots,
            num_stop_tokens=len(stop_tokens), constrained=constrained is not None))
    state = _on_mesh(empty_state(cfg, Bp, capacity, window_slots=window_slots,
                                 dtype=params.dtype), mesh)
    pad = jax.device_put(np.int32(cfg.eos_token_id if pad_id is None else pad_id))
    done = jax.device_put(np.arange(Bp) >= B)  # mesh padding rows never decode
    stops = stop_array(stop_tokens)
    width = decode_width(max_new_tokens, block)
    with mesh_context(params)[1]:
        logits, state = prefill(params, state, tokens, lengths, prefill_chunk)
    if constrained is not None:
        yield from _constrained_blocks(params, state, logits, done, sampling, pad, constrained,
                                       B=B, max_new_tokens=max_new_tokens, block=block,
                                       stops=stops, width=width,
                                       return_logprobs=return_logprobs)
        return
    produced = 0
    while produced < max_new_tokens:
        n = min(block, max_new_tokens - produced)
        last = produced + n >= max_new_tokens
        with mesh_context(params)[1]:
            out, logp, count, state, logits, done = _decode_block(
                params, state, logits, done, sampling, pad, n=width, stops=stops,
                limit=np.int32(n), feed_last=not last)
        produced += n
        # Sliced on the host: a device slice would compile a program per (rows, n).
        out_h, count_h, done_h, logp_h = jax.device_get((out, count, done, logp))
        yield GenerateOutput(out_h[:B, :n], count_h[:B], done_h[:B],
                             logp_h[:B, :n] if return_logprobs else None)
        if last or bool(done_h[:B].all()):
            return


def generate_programs(params: Params, batch: int, prompt_len: int, max_new_tokens: int, *,
                      block: int | None = None, prefill_chunk: int = 512,
                      max_len: int | None = None, window_slots: int | None = None,
                      num_stop_tokens: int = 1, constrained: bool = False) -> list[Job]:
    """The programs a single-device `generate` (block None) or `stream_generate(block=)` call
    with these shapes runs, as `compile_cache.Job`s: the empty state, the prefill chunk, and
    the decode loop (one per feed_last variant). `precompile(generate_programs(...))` compiles
    them in parallel; JAX's in-memory and persistent caches then serve the real call."""
    cfg = params.config
    block = max_new_tokens if block is None else max(1, int(block))
    capacity = max_len or min(_bucket(prompt_len + max_new_tokens), cfg.max_position_embeddings)
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
                                                           dtype=params.dtype)),
            Job(_prefill_chunk, (params, state, i32(batch, prefill_width(prompt_len,
                                                                          prefill_chunk)),
                                 i32(batch)))]
    for feed_last in (False, True)[:1 + (max_new_tokens > block)]:
        jobs.append(Job(_decode_block, (params, state, logits, done, sampling, i32()) + masks,
                        dict(n=width, stops=stops, limit=i32(), feed_last=feed_last)))
    return jobs


def _constrained_blocks(params, state, logits, done, sampling, pad, constrained, *, B,
                        max_new_tokens, block, stops, width, return_logprobs):
    """The decode blocks of `_generate_blocks` under per-step host masks (see `_decode_block`):
    rows [0, B) are the requests, any further rows mesh padding (free, already done)."""
    from deepinfer_fn.api import mesh_context
    constrained.pad_rows(done.shape[0])
    masks, failed = constrained.initial()
    done = done | jnp.asarray(failed)  # a constraint that failed to compile: the row never runs
    masks, sid = jnp.asarray(masks), jnp.int32(structured.register(constrained))
    try:
        produced = 0
        while produced < max_new_tokens:
            n = min(block, max_new_tokens - produced)
            last = produced + n >= max_new_tokens
            with mesh_context(params)[1]:
                out, logp, count, state, logits, done, masks = _decode_block(
                    params, state, logits, done, sampling, pad, masks, sid, n=width,
                    stops=stops, limit=np.int32(n), feed_last=not last)
            produced += n
            # waits for the block: the matchers are up to date
            out_h, count_h, done_h, logp_h = jax.device_get((out, count, done, logp))
            done_host = done_h[:B]
            final = last or bool(done_host.all())
            status = tuple(st if st is None or final or done_host[b] else "pending"
                           for b, st in enumerate(constrained.statuses()[:B]))
            yield GenerateOutput(out_h[:B, :n], count_h[:B], done_host,
                                 logp_h[:B, :n] if return_logprobs else None, status)
            if final:
                return
    finally:
        structured.unregister(int(sid))


# --- speculative decoding (MTP drafter) --------------------------------------------------


@functools.partial(jax.jit, donate_argnums=(1, 2))
def _spec_prefill_chunk(params, state, mstate, chunk, next_ids, n_new, n_mtp):
    """A prefill chunk of the backbone, then the MTP over the chunk's positions whose next
    token is known (n_mtp); also returns each row's streams at its last valid token."""
    logits, state, streams = transformer.forward_chunk(params, state, chunk, n_new)
    _, mstate, _ = spec.mtp_chunk(params, mstate, streams, next_ids, n_mtp)
    last = jnp.clip(n_new - 1, 0, chunk.shape[1] - 1)
    return logits, state, mstate, jnp.take_along_axis(streams, last[:, None, None, None], 1)[:, 0]


def _spec_prefill(params, state, mstate, tokens, lengths, chunk):
    """`prefill` for the speculative path: also advances the MTP state to lengths - 1 (the
    last prompt position waits for the first generated token) and returns the backbone
    streams of each row's last prompt token [B,n,D]."""
    last = None
    for ids, next_ids, n_new, ends_here in _prefill_chunks(tokens, lengths, chunk):
        n_mtp = n_new - ends_here.astype(np.int32)   # positions whose next token is known
        logits, state, mstate, streams = _spec_prefill_chunk(
            params, state, mstate, ids, jnp.asarray(next_ids), jnp.asarray(n_new),
            jnp.asarray(n_mtp))
        last = _keep_last(last, (logits, streams), ends_here)
    return last[0], last[1], state, mstate


def _spec_first_token(logits, sampling, lengths, done, masks, session, pad_id, stops, *,
                      n: int, width: int):
    """The first generated token of a speculative loop, sampled from the prefill logits as
    plain decoding does (under `masks`, then consumed by the host matchers, when constrained).
    Returns (first [B], out [B,width], logp [B,width], count [B], done [B], masks, ended [B]):
    the output buffers with the first token written, and the rows the constraint finished."""
    B = logits.shape[0]
    constrained = masks is not None
    allowed = structured.unpack_bitmask(masks, logits.shape[-1]) if constrained else None
    first, first_lp = sample(logits, sampling, lengths, allowed)
    active = ~done
    out = jnp.full((B, width), pad_id, jnp.int32).at[:, 0].set(jnp.where(active, first, pad_id))
    logp = jnp.zeros((B, width), jnp.float32).at[:, 0].set(jnp.where(active, first_lp, 0.0))
    count = active.astype(jnp.int32)
    ended = jnp.zeros((B,), bool)          # rows the constraint finished
    if constrained:
        masks, ended = io_callback(structured.host_step,
                                   (jax.ShapeDtypeStruct(masks.shape, jnp.uint32),
                                    jax.ShapeDtypeStruct((B,), jnp.bool_)),
                                   session, first, active, ordered=False)
        ended = ended & active
    done = done | jnp.isin(first, stops) | (n <= 1) | ended
    return first, out, logp, count, done, masks, ended


def _verify_and_emit(logits, drafts, q, sampling, step, ell, active, out, logp, count, stops,
                     constraint, *, n: int):
    """One verify step's accept/reject (`spec.verify` on the, possibly masked, target logits
    [B,k+1,V]) and the write of its emitted tokens into out/logp at each row's `count`,
    truncated after a stop token. constraint: None, or (masks [B,W], ended [B], session) for
    the `host_commit` io_callback that rolls the matchers back to the accepted drafts and
    consumes the correction/bonus token (it may keep fewer tokens: an accepted EOS draft).
    Returns (tokens [B,k+1], g [B], n_emit [B] (tokens the target state keeps), hit [B] (the
    row ended), out, logp, count, extra) with extra = (next masks, ended) or ()."""
    B, K1 = drafts.shape[0], drafts.shape[1] + 1
    j = jnp.arange(K1)[None]
    rows = jnp.arange(B)[:, None]
    tokens, g = spec.verify(logits, drafts, q, sampling, step, ell)
    n_emit = jnp.where(active, g + 1, 0)
    is_stop = jnp.isin(tokens, stops) & (j < n_emit[:, None])
    hit = jnp.any(is_stop, axis=1)
    n_out = jnp.where(hit, jnp.argmax(is_stop, axis=1) + 1, n_emit)
    extra = ()
    if constraint is not None:  # roll the matchers back to the accepted drafts, consume the rest
        masks, ended_before, session = constraint
        next_masks, ended, n_keep = io_callback(
            structured.host_commit,
            (jax.ShapeDtypeStruct(masks.shape, jnp.uint32),
             jax.ShapeDtypeStruct((B,), jnp.bool_), jax.ShapeDtypeStruct((B,), jnp.int32)),
            session, tokens, g, n_out, active, ordered=False)
        ended = ended & active
        n_out = jnp.where(active, jnp.minimum(n_out, n_keep), 0)
        hit = hit | ended
        extra = (next_masks, ended_before | ended)
    idx = jnp.where(j < n_out[:, None], count[:, None] + j, out.shape[1])
    out = out.at[rows, idx].set(tokens, mode="drop")
    lp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[..., None], -1)[..., 0]
    logp = logp.at[rows, idx].set(lp, mode="drop")
    return tokens, g, n_emit, hit, out, logp, count + n_out, extra


def _stops(stop_tokens: tuple[int, ...]) -> jax.Array:
    return jnp.asarray(stop_tokens if stop_tokens else (-1,), jnp.int32)


def _rows_where(active, new, old):
    """Per row (leading axis), `new` where active else `old` (pytrees of equal shapes)."""
    return jax.tree.map(
        lambda a, b: jnp.where(active.reshape((-1,) + (1,) * (a.ndim - 1)), a, b), new, old)


def _record(hist, step, active, value):
    """hist [B, n, ...] with value [B, ...] written at each active row's own step index
    (an active row's step is < n: every step commits at least one of its n tokens)."""
    rows, at = jnp.arange(hist.shape[0]), jnp.minimum(step, hist.shape[1] - 1)
    keep = active.reshape((-1,) + (1,) * (hist.ndim - 2))
    return hist.at[rows, at].set(jnp.where(keep, value.astype(hist.dtype), hist[rows, at]))


def _spec_carry(first_token_out, state, *, n: int, extra: dict) -> dict:
    """The loop carry of a speculative decode, after `_spec_first_token`: the target state,
    the output buffers, count/done/step per row, the per-step histories (accepted, verified:
    -1 where a row ran no such step), the constraint's masks/ended, plus the drafter's `extra`."""
    first, out, logp, count, done, masks, ended = first_token_out
    B = count.shape[0]
    hist = jnp.full((B, n), -1, jnp.int32)
    carry = dict(state=state, out=out, logp=logp, count=count, done=done,
                 step=jnp.zeros((B,), jnp.int32), acc=hist, ver=hist, ended=ended, **extra)
    if masks is not None:
        carry["masks"] = masks
    return carry


def _runnable(carry, until):
    """Rows that take a step in this segment: not done and short of `until` tokens."""
    return ~carry["done"] & (carry["count"] < until)


@functools.partial(jax.jit, static_argnames=("n", "k", "stop_tokens"), donate_argnums=(1, 2))
def _mtp_start(params: Params, state: DecodeState, mstate: DecodeState, logits, last_streams,
               done, sampling: SamplingParams, pad_id, masks=None, session=None, *, n: int,
               k: int, stop_tokens: tuple[int, ...]) -> dict:
    """The MTP loop's carry: the first token sampled from the prefill logits as plain decoding
    does (under `masks`, consumed by the host matchers, when constrained), and the MTP's
    pending input: the backbone streams and next tokens of the positions committed last (at
    most k + 1; here the prompt's last position and the first token)."""
    B, K1 = logits.shape[0], k + 1
    first = _spec_first_token(logits, sampling, state.lengths, done, masks, session, pad_id,
                              _stops(stop_tokens), n=n, width=n + K1)
    pend_streams = jnp.zeros((B, K1) + last_streams.shape[1:], last_streams.dtype)
    extra = dict(mstate=mstate, pend_streams=pend_streams.at[:, 0].set(last_streams),
                 pend_ids=jnp.zeros((B, K1), jnp.int32).at[:, 0].set(first[0]),
                 pend_n=jnp.where(first[4], 0, 1).astype(jnp.int32))
    return _spec_carry(first, state, n=n, extra=extra)


@functools.partial(jax.jit, static_argnames=("n", "k", "stop_tokens"), donate_argnums=(1,))
def _mtp_steps(params: Params, carry: dict, sampling: SamplingParams, until, session=None, *,
               n: int, k: int, stop_tokens: tuple[int, ...]) -> dict:
    """`lax.while_loop` steps of draft (MTP, k tokens) -> verify (one forward of the anchor + k
    drafts, all logits) -> accept (per row) -> rollback -> MTP catch-up, until every row is
    done or has `until` tokens (rows past it wait: no step, no key consumed, their pending
    MTP input kept; `until` = n runs to the end).

    Constrained (carry["masks"]: packed uint32 [B,W], the grammar state after the committed
    tokens, m_0; session: int32 id of a registered `structured.ConstrainedBatch`; structured.py,
    "speculative decoding"): each step drafts under m_0..m_{k-1} with one `host_draft`
    io_callback per slot (returning m_1..m_k), verifies against the target logits masked by
    m_0..m_k (draft slots after a drafted EOS or dead end are not admitted), and one
    `host_commit` io_callback rolls the matchers back to the accepted drafts, consumes the
    correction/bonus token and returns the next m_0, the rows the constraint finished and how
    many committed tokens stay (an accepted EOS draft drops the bonus after it). Logprobs are
    those of the masked logits, as in `_decode_block`."""
    V = params.config.vocab_size
    constrained = "masks" in carry
    stops = _stops(stop_tokens)

    def body(c):
        active = _runnable(c, until)
        state, mstate, count, step = c["state"], c["mstate"], c["count"], c["step"]
        pend_ids, pend_n = c["pend_ids"], c["pend_n"]
        B = count.shape[0]
        ell = jnp.where(active, jnp.clip(n - count - 1, 0, k), 0)
        anchor = jnp.take_along_axis(pend_ids, jnp.maximum(pend_n - 1, 0)[:, None], 1)[:, 0]
        pending = jnp.where(active, pend_n, 0)
        if constrained:  # grammar masks at every draft slot, one host call per slot
            def host(x):
                return io_callback(structured.host_draft,
                                   (jax.ShapeDtypeStruct(c["masks"].shape, jnp.uint32),
                                    jax.ShapeDtypeStruct((B,), jnp.bool_)),
                                   session, x, active, ordered=False)
            drafts, q, mstate, dmasks, dstop = spec.draft(
                params, mstate, c["pend_streams"], pend_ids, pending, k, sampling, step,
                constrain=(c["masks"], host))
            # Slots after a drafted EOS / dead end are not admitted (decided from x_j, §2.5).
            first_stop = jnp.where(jnp.any(dstop, 1), jnp.argmax(dstop, 1) + 1, k)
            ell = jnp.minimum(ell, first_stop)
        else:
            drafts, q, mstate = spec.draft(params, mstate, c["pend_streams"], pend_ids, pending,
                                           k, sampling, step)
        ids = jnp.concatenate([anchor[:, None], drafts], axis=1)
        logits, new_state, streams = transformer.forward_chunk(
            params, state, ids, jnp.where(active, ell + 1, 0), all_logits=True)
        if constrained:  # p~_j under the grammar state after the anchor and x_1..x_j
            logits = jnp.where(structured.unpack_bitmask(dmasks, V), logits, -jnp.inf)
        tokens, g, n_emit, hit, out, logp, count, extra = _verify_and_emit(
            logits, drafts, q, sampling, step, ell, active, c["out"], c["logp"], count, stops,
            (c["masks"], c["ended"], session) if constrained else None, n=n)
        done = c["done"] | hit | (count >= n)
        new = dict(c, state=spec.rollback(new_state, state.lengths + n_emit), mstate=mstate,
                   out=out, logp=logp, count=count, done=done,
                   step=step + active.astype(jnp.int32),
                   acc=_record(c["acc"], step, active, g), ver=_record(c["ver"], step, active, ell),
                   pend_streams=_rows_where(active, streams, c["pend_streams"]),
                   pend_ids=_rows_where(active, tokens, pend_ids),
                   pend_n=jnp.where(active, jnp.where(done, 0, n_emit), pend_n))
        if constrained:
            new["masks"], new["ended"] = extra
        return new

    return jax.lax.while_loop(lambda c: jnp.any(_runnable(c, until)), body, carry)


@functools.partial(jax.jit, static_argnames=("stop_tokens",))
def _spec_stopped(out, count, ended, *, stop_tokens: tuple[int, ...]):
    """bool [B]: rows that ended right after a stop token, or that their constraint ended."""
    last = jnp.take_along_axis(out, jnp.maximum(count - 1, 0)[:, None], 1)[:, 0]
    return ((count > 0) & jnp.isin(last, _stops(stop_tokens))) | ended


def _speculative_generate(params, tokens, lengths, *, method, k, max_new_tokens, temperature,
                          top_k, top_p, min_p, seed, stop_tokens, return_logprobs, pad_id,
                          prefill_chunk, max_len, window_slots, constraint=None,
                          tokenizer=None, drafter=None, verify_len="fixed",
                          verify_cost=None) -> GenerateOutput:
    """`generate(..., speculative=...)`: the whole run as one segment."""
    runs = _speculative_run(params, tokens, lengths, method=method, k=k, drafter=drafter,
                            verify_len=verify_len, verify_cost=verify_cost,
                            max_new_tokens=max_new_tokens, block=max_new_tokens,
                            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            seed=seed, stop_tokens=stop_tokens, pad_id=pad_id,
                            prefill_chunk=prefill_chunk, max_len=max_len,
                            window_slots=window_slots, constraint=constraint,
                            tokenizer=tokenizer)
    for seg in runs:
        pass
    c, B, n = seg.carry, seg.rows, max_new_tokens
    return GenerateOutput(c["out"][:B, :n], c["count"][:B], seg.stopped[:B],
                          c["logp"][:B, :n] if return_logprobs else None, seg.statuses,
                          accepted=c["acc"][:B], verified=c["ver"][:B],
                          draft_confidence=c["conf"][:B] if "conf" in c else None)


def _speculative_pieces(runs, *, pad_id, return_logprobs):
    """`stream_generate(..., speculative=...)`: per segment, each row's tokens committed since
    the previous one (a GenerateOutput whose `lengths` counts them, padded with pad_id), the
    histories so far (accepted / verified / draft_confidence: -1 / 0 for steps not run yet)."""
    prev = None
    for seg in runs:
        c, B = seg.carry, seg.rows
        count = np.asarray(c["count"])[:B]
        prev = np.zeros_like(count) if prev is None else prev
        width = max(1, int((count - prev).max()))
        cols = prev[:, None] + np.arange(width)[None]
        keep = cols < count[:, None]
        take = np.minimum(cols, c["out"].shape[1] - 1)
        toks = np.where(keep, np.take_along_axis(np.asarray(c["out"])[:B], take, 1), pad_id)
        logp = (np.where(keep, np.take_along_axis(np.asarray(c["logp"])[:B], take, 1), 0.0)
                if return_logprobs else None)
        yield GenerateOutput(jnp.asarray(toks, jnp.int32), jnp.asarray(count - prev),
                             seg.stopped[:B],
                             None if logp is None else jnp.asarray(logp, jnp.float32),
                             seg.statuses, accepted=c["acc"][:B], verified=c["ver"][:B],
                             draft_confidence=c["conf"][:B] if "conf" in c else None)
        prev = count


@dataclasses.dataclass
class _Segment:
    """One segment of a speculative run: the loop carry (device arrays, mesh padding rows
    included), the number of real rows, stopped bool [rows+padding], statuses."""
    carry: dict
    rows: int
    stopped: jax.Array
    statuses: tuple | None


def _run_segments(carry, advance, *, n: int, block: int, stop_tokens, B: int,
                  constrained=None, failed=None):
    """Yields a `_Segment` after `advance(carry, until)` for until = block, 2 block, ... n
    (ends early once every row is done); the constraint's statuses are "pending" for the
    rows still running in a segment that is not the last."""
    until = 0
    while True:
        until = min(until + block, n)
        carry = advance(carry, jnp.int32(until))
        stopped = _spec_stopped(carry["out"], carry["count"], carry["ended"],
                                stop_tokens=stop_tokens)
        # the last segment does not wait for the device (unless the matchers must be read)
        final = until >= n or bool(np.asarray(carry["done"])[:B].all())
        statuses = None
        if constrained is not None:   # waits for the loop: the matchers are up to date
            done = np.asarray(carry["done"])[:B]
            stopped = jnp.asarray(np.asarray(stopped) | failed)
            statuses = tuple(st if st is None or final or done[b] else "pending"
                             for b, st in enumerate(constrained.statuses()[:B]))
        yield _Segment(carry, B, stopped, statuses)
        if final:
            return


def _speculative_run(params, tokens, lengths, *, method, k, max_new_tokens, block, temperature,
                     top_k, top_p, min_p, seed, stop_tokens, pad_id, prefill_chunk, max_len,
                     window_slots, constraint=None, tokenizer=None, drafter=None,
                     verify_len="fixed", verify_cost=None):
    """Generator of `_Segment`s of a speculative run (validation happens at the first step)."""
    from deepinfer_fn.api import mesh_context
    cfg = params.config
    if method == "dspark":
        yield from _dspark_run(
            params, tokens, lengths, drafter=drafter, k=k, verify_len=verify_len,
            verify_cost=verify_cost, max_new_tokens=max_new_tokens, block=block,
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
            stop_tokens=stop_tokens, pad_id=pad_id, prefill_chunk=prefill_chunk,
            max_len=max_len, window_slots=window_slots, constraint=constraint,
            tokenizer=tokenizer)
        return
    if method != "mtp":
        raise ValueError(f"speculative={method!r}: expected 'mtp' or 'dspark'")
    if drafter is not None:
        raise ValueError("drafter= is only used with speculative='dspark'")
    k = 3 if k is None else k
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"num_draft_tokens must be a positive int, got {k!r}")
    if not params["mtp"]:
        raise ValueError("speculative='mtp' needs params with an MTP block (these have none)")
    k = int(k)
    B = tokens.shape[0]
    constrained = None
    if constraint is not None:  # compiled per request on the host; a bad grammar fails its row
        constrained = structured.ConstrainedBatch.build(
            constraint, B, structured.default_tokenizer() if tokenizer is None else tokenizer,
            cfg.vocab_size)
    mesh, tokens, lengths, sampling = _mesh_rows(params, tokens, lengths, temperature, top_k,
                                                 top_p, min_p, seed)
    Bp = tokens.shape[0]
    capacity = max_len or min(_bucket(int(lengths.max()) + max_new_tokens + k + 1),
                              cfg.max_position_embeddings)
    # Rejected drafts must not overwrite live ring entries: sliding_window + k slots.
    slots = max(window_slots or 0, cfg.sliding_window + k)
    state = _on_mesh(init_state(cfg, Bp, capacity, window_slots=slots, dtype=params.dtype), mesh)
    mstate = _on_mesh(spec.init_mtp_state(cfg, Bp, capacity, window_slots=slots,
                                          dtype=params.dtype), mesh)
    with mesh_context(params)[1]:
        logits, last_streams, state, mstate = _spec_prefill(params, state, mstate, tokens,
                                                            lengths, prefill_chunk)
    pad = jnp.int32(cfg.eos_token_id if pad_id is None else pad_id)
    done = jnp.arange(Bp) >= B  # mesh padding rows never decode
    kw = dict(n=max_new_tokens, k=k, stop_tokens=stop_tokens)
    yield from _drive(
        params, constrained, done,
        lambda done, masks, sid: _mtp_start(params, state, mstate, logits, last_streams, done,
                                            sampling, pad, masks, sid, **kw),
        lambda carry, until, sid: _mtp_steps(params, carry, sampling, until, sid, **kw),
        n=max_new_tokens, block=block, stop_tokens=stop_tokens, B=B)


def _drive(params, constrained, done, start, steps, **segments):
    """The segments of a speculative run (`_run_segments`) under the params' mesh:
    start(done, masks, session) -> carry; steps(carry, until, session) -> carry. With a
    `structured.ConstrainedBatch`, its rows (mesh padding: free rows) are registered for the
    host callbacks for the run's lifetime, and a constraint that failed to compile leaves its
    row done from the start (it never runs; the others are unaffected)."""
    from deepinfer_fn.api import mesh_context
    masks = sid = failed = None
    if constrained is not None:
        constrained.pad_rows(done.shape[0])
        masks, failed = constrained.initial()
        done, masks = done | jnp.asarray(failed), jnp.asarray(masks)
        sid = jnp.int32(structured.register(constrained))

    def advance(carry, until):
        with mesh_context(params)[1]:
            return steps(carry, until, sid)

    try:
        with mesh_context(params)[1]:
            carry = start(done, masks, sid)
        yield from _run_segments(carry, advance, constrained=constrained, failed=failed,
                                 **segments)
    finally:
        if sid is not None:
            structured.unregister(int(sid))


# --- speculative decoding (DSpark drafter) -----------------------------------------------


@functools.partial(jax.jit, donate_argnums=(2, 3))
def _dspark_prefill_chunk(params, drafter, state, dstate, chunk, n_new):
    """A prefill chunk of the target that also pushes the chunk's tapped features into the
    draft context rings (spec/dspark.md §1.2: taps captured in every chunk)."""
    dcfg = drafter.config
    logits, state, _, feats = transformer.forward_chunk(
        params, state, chunk, n_new, taps=dcfg.target_layer_ids, tap=dcfg.tap)
    dstate = spec.dspark.push(drafter, params.config, dstate, feats, n_new)
    return logits, state, dstate


def _dspark_prefill(params, drafter, state, dstate, tokens, lengths, chunk):
    """`prefill` for the DSpark path: target state and draft context both reach lengths."""
    last = None
    for ids, _, n_new, ends_here in _prefill_chunks(tokens, lengths, chunk):
        logits, state, dstate = _dspark_prefill_chunk(params, drafter, state, dstate, ids,
                                                      jnp.asarray(n_new))
        last = _keep_last(last, logits, ends_here)
    return last, state, dstate


def _verify_lengths(conf, active, cap, sched, mode: str, seed, step):
    """ell [B]: cap ("fixed"); the scheduler's padded verify length ("scheduled" with the
    traced flag sched[4] set: verify_len="dynamic", deepinfer_fn/speculative/schedule.py;
    decided from confidences only: non-anticipating), or cap (flag clear: verify_len="fixed"
    sharing the dynamic program); or uniform in 0..cap per row and step ("random": a
    diagnostic mode for losslessness tests, spec §6.3; its key is the DRAFT stream at slot γ,
    which no draft uses)."""
    if mode == "fixed":
        return cap
    if mode == "random":
        keys = request_key(seed, None, step=step, slot=conf.shape[1], role=Role.DRAFT)
        u = jax.vmap(lambda k: jax.random.uniform(k, ()))(keys)
        return jnp.minimum((u * (cap + 1).astype(jnp.float32)).astype(jnp.int32), cap)
    from deepinfer_fn.speculative import schedule
    temps, step_seconds, overhead, eps, dynamic = sched
    ell = schedule.padded_verify_len(conf, temps, active, cap, step_seconds, overhead, eps)
    return jnp.where(dynamic, jnp.clip(ell.astype(jnp.int32), 0, cap), cap)


@functools.partial(jax.jit, static_argnames=("n", "gamma", "stop_tokens"), donate_argnums=(0, 1))
def _dspark_start(state: DecodeState, dstate: DecodeState, logits, done,
                  sampling: SamplingParams, pad_id, masks=None, session=None, *, n: int,
                  gamma: int, stop_tokens: tuple[int, ...]) -> dict:
    """The DSpark loop's carry: the first token sampled from the prefill logits as plain
    decoding does (the first anchor), the draft context state, the confidence history."""
    B = logits.shape[0]
    first = _spec_first_token(logits, sampling, state.lengths, done, masks, session, pad_id,
                              _stops(stop_tokens), n=n, width=n + gamma + 1)
    extra = dict(dstate=dstate, anchor=first[0], conf=jnp.zeros((B, n, gamma), jnp.float32))
    return _spec_carry(first, state, n=n, extra=extra)


@functools.partial(jax.jit, static_argnames=("n", "stop_tokens", "mode", "column_buckets"),
                   donate_argnums=(2,))
def _dspark_steps(params: Params, drafter, carry: dict, sampling: SamplingParams, sched, until,
                  session=None, *, n: int, stop_tokens: tuple[int, ...], mode: str,
                  column_buckets: tuple[int, ...] | None = None) -> dict:
    """`lax.while_loop` steps of draft (DSpark block of γ) -> verify ell_b + 1 tokens per row
    (one all-logits forward with the taps) -> accept -> rollback of the target state -> push
    the committed positions' features (anchor + accepted drafts) into the draft context, until
    every row is done or has `until` tokens (rows past it wait: no step, no key consumed).
    The draft context therefore only ever holds committed positions and is at the target's
    length whenever a block is drafted. Dynamic and random modes run the verify forward on the
    smallest of `column_buckets` (default every width) that holds 1 + max(ell) columns
    (`schedule.run_with_columns`); the dynamic scheduler decides over the rows stepping now.

    Constrained (carry["masks"], session), as `_mtp_steps`: each step carries m_0 and the
    Markov pass draws slot j + 1 under m_j (one `host_draft` io_callback per slot, so q is the
    masked distribution the draft came from, spec/dspark.md §2.2); the verify length is capped
    before the scheduler by the slots the drafts admit (none after a drafted EOS / dead end: a
    function of earlier drafts only, §2.5); the target logits are masked by m_0..m_γ;
    `host_commit` rolls the matchers back to the accepted drafts. Without masks the program is
    the unconstrained one, unchanged."""
    dcfg = drafter.config
    g_max = dcfg.block_size
    V = params.config.vocab_size
    constrained = "masks" in carry
    stops = _stops(stop_tokens)

    def body(c):
        active = _runnable(c, until)
        state, dstate, anchor, count, step = (c["state"], c["dstate"], c["anchor"], c["count"],
                                              c["step"])
        B = count.shape[0]
        cap = jnp.where(active, jnp.clip(n - count - 1, 0, g_max), 0)
        if constrained:  # grammar masks inside the Markov pass, one host call per slot
            def host(x):
                return io_callback(structured.host_draft,
                                   (jax.ShapeDtypeStruct(c["masks"].shape, jnp.uint32),
                                    jax.ShapeDtypeStruct((B,), jnp.bool_)),
                                   session, x, active, ordered=False)
            drafts, q, conf, dmasks, dstop = spec.dspark.draft(
                drafter, params, dstate, anchor, sampling, step, constrain=(c["masks"], host))
            # Slots after a drafted EOS / dead end are not admitted (decided from x_j, §2.5).
            cap = jnp.minimum(cap, jnp.where(jnp.any(dstop, 1), jnp.argmax(dstop, 1) + 1, g_max))
        else:
            drafts, q, conf = spec.dspark.draft(drafter, params, dstate, anchor, sampling, step)
        ell = jnp.where(active, _verify_lengths(conf, active, cap, sched, mode, sampling.seed,
                                                step), 0)
        ids = jnp.concatenate([anchor[:, None], drafts], axis=1)
        n_new = jnp.where(active, ell + 1, 0)

        def verify_forward(ids_s):
            lg, st, _, ft = transformer.forward_chunk(params, state, ids_s, n_new,
                                                      all_logits=True,
                                                      taps=dcfg.target_layer_ids, tap=dcfg.tap)
            return (lg, ft), st

        if mode == "fixed":
            (logits, feats), new_state = verify_forward(ids)
        else:  # the padded forward runs 1 + max(ell) columns: shorter ell saves compute
            from deepinfer_fn.speculative import schedule
            (logits, feats), new_state = schedule.run_with_columns(
                verify_forward, ids, schedule.verify_columns(ell, active), column_buckets)
        if constrained:  # p~_j under the grammar state after the anchor and x_1..x_j
            logits = jnp.where(structured.unpack_bitmask(dmasks, V), logits, -jnp.inf)
        tokens, g, n_emit, hit, out, logp, count, extra = _verify_and_emit(
            logits, drafts, q, sampling, step, ell, active, c["out"], c["logp"], count, stops,
            (c["masks"], c["ended"], session) if constrained else None, n=n)
        new = dict(c, state=spec.rollback(new_state, state.lengths + n_emit),
                   dstate=spec.dspark.push(drafter, params.config, dstate, feats, n_emit),
                   anchor=jnp.where(active, jnp.take_along_axis(tokens, g[:, None], 1)[:, 0],
                                    anchor),
                   out=out, logp=logp, count=count, done=c["done"] | hit | (count >= n),
                   step=step + active.astype(jnp.int32),
                   acc=_record(c["acc"], step, active, g), ver=_record(c["ver"], step, active, ell),
                   conf=_record(c["conf"], step, active, conf))
        if constrained:
            new["masks"], new["ended"] = extra
        return new

    return jax.lax.while_loop(lambda c: jnp.any(_runnable(c, until)), body, carry)


def _dspark_schedule_args(drafter, verify_len, verify_cost, batch: int):
    """((temps [γ], step_seconds [γ+1], overhead, eps, dynamic flag), column buckets) for the
    "scheduled" program (verify_len "dynamic", or "fixed" given a profile: flag False), else
    (None, None). Only the widths where the profile gets >= 10% cheaper are compiled
    (`schedule.column_buckets`), and the scheduler sees the cost of the width that actually
    runs (`schedule.bucketed_seconds`)."""
    from deepinfer_fn.speculative import schedule
    if verify_len == "random" or (verify_len == "fixed" and verify_cost is None):
        if verify_cost is not None:
            raise ValueError(f"verify_cost is only used with verify_len='dynamic' or 'fixed', "
                             f"not {verify_len!r}")
        return None, None
    if verify_cost is not None and not callable(getattr(verify_cost, "step_seconds_for", None)):
        raise ValueError(f"verify_cost must be a speculative.schedule.VerifyCost profile, got "
                         f"{type(verify_cost).__name__}")
    if verify_cost is None:
        raise ValueError("verify_len='dynamic' needs verify_cost= (a speculative.schedule."
                         "VerifyCost profile of the verify forward)")
    g = drafter.config.block_size
    step_seconds = np.asarray(verify_cost.step_seconds_for(batch), np.float32)
    if step_seconds.shape != (g + 1,):
        raise ValueError(f"verify_cost.step_seconds_for({batch}) has shape {step_seconds.shape}; "
                         f"expected ({g + 1},) for a drafter with block size {g}")
    overhead = float(getattr(verify_cost, "overhead_seconds", 0.0))
    eps = float(getattr(verify_cost, "eps", 0.0))
    buckets = schedule.column_buckets(step_seconds)
    step_seconds = schedule.bucketed_seconds(step_seconds, buckets).astype(np.float32)
    return ((drafter.sts_temperatures.astype(jnp.float32), jnp.asarray(step_seconds),
             jnp.float32(overhead), jnp.float32(eps), jnp.asarray(verify_len == "dynamic")),
            buckets)


def _dspark_run(params, tokens, lengths, *, drafter, k, verify_len, verify_cost,
                max_new_tokens, block, temperature, top_k, top_p, min_p, seed, stop_tokens,
                pad_id, prefill_chunk, max_len, window_slots, constraint=None, tokenizer=None):
    """`_speculative_run` for the DSpark drafter."""
    from deepinfer_fn.api import mesh_context
    from deepinfer_fn.speculative.dspark import DSpark, check_target, init_draft_state
    cfg = params.config
    if not isinstance(drafter, DSpark):
        raise ValueError("speculative='dspark' needs drafter=<a loaded DSpark drafter>, e.g. "
                         "deepinfer_fn.speculative.load_dspark(path, params) (got "
                         f"{type(drafter).__name__})")
    check_target(drafter.config, cfg)
    gamma = drafter.config.block_size
    if k is not None and k != gamma:
        raise ValueError(f"num_draft_tokens={k!r} but this DSpark drafter has block size "
                         f"{gamma}: the draft width is a checkpoint constant (spec/dspark.md "
                         f"§1.1); leave num_draft_tokens unset (verify_len picks how many to verify)")
    if verify_len not in ("fixed", "dynamic", "random"):
        raise ValueError(f"verify_len must be 'fixed', 'dynamic' or 'random', got {verify_len!r}")
    B = tokens.shape[0]
    constrained = None
    if constraint is not None:  # compiled per request on the host; a bad grammar fails its row
        constrained = structured.ConstrainedBatch.build(
            constraint, B, structured.default_tokenizer() if tokenizer is None else tokenizer,
            cfg.vocab_size)
    mesh, tokens, lengths, sampling = _mesh_rows(params, tokens, lengths, temperature, top_k,
                                                 top_p, min_p, seed)
    Bp = tokens.shape[0]
    # the verify forward of a sharded run processes Bp / (batch shards) rows per device
    per_device = Bp if mesh is None else Bp // _batch_shards(mesh)
    sched, buckets = _dspark_schedule_args(drafter, verify_len, verify_cost, per_device)
    capacity = max_len or min(_bucket(int(lengths.max()) + max_new_tokens + gamma + 1),
                              cfg.max_position_embeddings)
    slots = max(window_slots or 0, cfg.sliding_window + gamma)   # rollback slack (state.py)
    state = _on_mesh(init_state(cfg, Bp, capacity, window_slots=slots, dtype=params.dtype), mesh)
    dstate = _on_mesh(init_draft_state(cfg, drafter.config, Bp, capacity, dtype=params.dtype),
                      mesh)
    if mesh is not None:   # the drafter is small: a full copy on every device
        drafter = jax.device_put(drafter, jax.sharding.NamedSharding(mesh,
                                                                     jax.sharding.PartitionSpec()))
    with mesh_context(params)[1]:
        logits, state, dstate = _dspark_prefill(params, drafter, state, dstate, tokens, lengths,
                                                prefill_chunk)
    pad = jnp.int32(cfg.eos_token_id if pad_id is None else pad_id)
    done = jnp.arange(Bp) >= B  # mesh padding rows never decode
    mode = "scheduled" if sched is not None else verify_len
    kw = dict(n=max_new_tokens, stop_tokens=stop_tokens, mode=mode, column_buckets=buckets)
    start = dict(n=max_new_tokens, gamma=gamma, stop_tokens=stop_tokens)
    yield from _drive(
        params, constrained, done,
        lambda done, masks, sid: _dspark_start(state, dstate, logits, done, sampling, pad,
                                               masks, sid, **start),
        lambda carry, until, sid: _dspark_steps(params, drafter, carry, sampling, sched, until,
                                                sid, **kw),
        n=max_new_tokens, block=block, stop_tokens=stop_tokens, B=B)


def _batch_shards(mesh) -> int:
    from shardings.mesh import batch_shards
    return batch_shards(mesh)
