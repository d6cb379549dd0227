"""The functional generation API: chunked prefill, then one jitted decode loop (DESIGN.md).

`generate(params, tokens, lengths=..., max_new_tokens=...)` prefills every prompt (ragged:
row b has lengths[b] real tokens, the rest of the row is ignored) in fixed-size chunks, then
runs a `lax.while_loop` that samples, feeds each row its own token and stops rows
independently; the decode state is donated, and nothing returns to the host until the end.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from deepinfer_fn.model import transformer
from deepinfer_fn.params import Params
from deepinfer_fn.sampling import SamplingParams, sample, sampling_params
from deepinfer_fn.state import DecodeState, init_state
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
    row produced nothing)."""

    tokens: jax.Array
    lengths: jax.Array
    stopped: jax.Array
    logprobs: jax.Array | None = None
    constraint_status: tuple[str | None, ...] | None = dataclasses.field(
        default=None, metadata=dict(static=True))

    def finish_reasons(self) -> list[str]:
        status = self.constraint_status or (None,) * len(self.stopped)
        return ["error" if st is not None and st.startswith("error") else "stop" if s else "length"
                for s, st in zip(np.asarray(self.stopped), status)]


def _bucket(n: int, minimum: int = 256) -> int:
    """Round a capacity up to a power of two so repeated calls reuse compiled programs."""
    return max(minimum, 1 << (int(n) - 1).bit_length())


@functools.partial(jax.jit, donate_argnums=(1,))
def _prefill_chunk(params, state, chunk, n_new):
    logits, state, _ = transformer.forward_chunk(params, state, chunk, n_new)
    return logits, state


@functools.partial(jax.jit, static_argnames=("n", "stop_tokens", "feed_last"),
                   donate_argnums=(1,))
def _decode_block(params: Params, state: DecodeState, logits, done, sampling: SamplingParams,
                  pad_id, masks=None, session=None, *, n: int, stop_tokens: tuple[int, ...],
                  feed_last: bool):
    """Samples up to n tokens per row inside one `lax.while_loop`, feeding each row its own
    token (rows that stopped feed nothing and keep their state). Returns
    (tokens [B,n], logprobs [B,n], counts [B], state, next logits [B,V], done [B]);
    with feed_last=False the n-th token is not fed (no wasted model step at the very end).

    Constrained (masks: packed allowed-token bits uint32 [B, ceil(V/32)] for the first step;
    session: int32 id of a registered `structured.ConstrainedBatch`): each step samples under
    the unpacked masks, then one io_callback hands the sampled tokens to the host, which
    advances the matchers and returns the next step's masks and the rows whose constraint
    finished (they stop). The last masks come back as a 7th output, for the next block.
    """
    B = logits.shape[0]
    stops = jnp.asarray(stop_tokens if stop_tokens else (-1,), jnp.int32)
    constrained = masks is not None

    def cond(loop):
        i, done = loop[0], loop[6]
        return (i < n) & ~jnp.all(done)

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
            state, logits = jax.lax.cond(i + 1 < n, step, lambda a: a, (state, logits))
        return (i + 1, state, logits, out, logp, count, done) + extra

    init = (jnp.int32(0), state, logits, jnp.full((B, n), pad_id, jnp.int32),
            jnp.zeros((B, n), jnp.float32), jnp.zeros((B,), jnp.int32), done)
    init += (masks,) if constrained else ()
    _, state, logits, out, logp, count, done, *rest = jax.lax.while_loop(cond, body, init)
    return (out, logp, count, state, logits, done, *rest)


def check_prompts(tokens, lengths, cfg, max_new_tokens: int, max_len: int | None):
    """Host-side validation of a prompt batch; returns (tokens int32 [B,T], lengths int32 [B])."""
    arr = np.asarray(tokens)
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2:
        raise ValueError(f"tokens must be [batch, length], got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"empty prompt batch (tokens shape {arr.shape})")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"tokens must hold integer token ids, got dtype {arr.dtype}")
    B, T = arr.shape
    lens = np.full((B,), T, np.int64) if lengths is None else np.asarray(lengths).astype(np.int64)
    if lens.shape != (B,):
        raise ValueError(f"lengths has shape {lens.shape}, expected ({B},) for {B} prompts")
    if np.any(lens < 1):
        raise ValueError(f"empty prompt(s): rows {np.flatnonzero(lens < 1).tolist()} have length < 1")
    if np.any(lens > T):
        raise ValueError(f"lengths {lens.tolist()} exceed the token array width {T}")
    real = np.arange(T)[None] < lens[:, None]
    bad = real & ((arr < 0) | (arr >= cfg.vocab_size))
    if bad.any():
        row, col = np.argwhere(bad)[0]
        raise ValueError(f"token id {int(arr[row, col])} at row {row}, position {col} is outside "
                         f"the vocabulary [0, {cfg.vocab_size})")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    limit = cfg.max_position_embeddings if max_len is None else min(max_len, cfg.max_position_embeddings)
    over = lens + max_new_tokens > limit
    if over.any():
        r = int(np.flatnonzero(over)[0])
        raise ValueError(f"prompt {r} ({int(lens[r])} tokens) + max_new_tokens {max_new_tokens} "
                         f"exceeds the context limit of {limit} tokens")
    return np.where(real, arr, 0).astype(np.int32), lens.astype(np.int32)


def check_stop_tokens(stop_tokens, cfg) -> tuple[int, ...]:
    stop_tokens = tuple(int(t) for t in stop_tokens)
    bad = [t for t in stop_tokens if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ValueError(f"stop_tokens {bad} are outside the vocabulary [0, {cfg.vocab_size})")
    return stop_tokens


def prefill(params: Params, state: DecodeState, tokens: np.ndarray, lengths: np.ndarray,
            chunk: int):
    """Chunked prefill of right-padded prompts; returns (last-token logits [B,V], state)."""
    B, T = tokens.shape
    chunk = max(1, min(chunk, -(-T // 16) * 16))
    padded = -(-T // chunk) * chunk
    tokens = np.pad(tokens, ((0, 0), (0, padded - T)))
    last_logits = None
    for off in range(0, padded, chunk):
        n_new = np.clip(lengths - off, 0, chunk).astype(np.int32)
        if not n_new.any():
            break
        logits, state = _prefill_chunk(params, state, jnp.asarray(tokens[:, off:off + chunk]),
                                       jnp.asarray(n_new))
        ends_here = jnp.asarray((lengths > off) & (lengths <= off + chunk))
        last_logits = logits if last_logits is None else jnp.where(ends_here[:, None], logits,
                                                                   last_logits)
    return last_logits, state


def generate(params: Params, tokens, *, lengths=None, max_new_tokens: int,
             temperature=0.0, top_k=None, top_p=None, min_p=None, seed=0,
             stop_tokens: Sequence[int] = (), return_logprobs: bool = False,
             pad_id: int | None = None, prefill_chunk: int = 512, max_len: int | None = None,
             window_slots: int | None = None, constraint=None, tokenizer=None) -> GenerateOutput:
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
    """
    if not isinstance(params, Params):
        raise TypeError(f"params must be deepinfer_fn.Params, got {type(params).__name__}")
    cfg = params.config
    tokens, lengths = check_prompts(tokens, lengths, cfg, max_new_tokens, max_len)
    stop_tokens = check_stop_tokens(stop_tokens, cfg)
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
    The last output of each row is padded after it stops."""
    if not isinstance(params, Params):
        raise TypeError(f"params must be deepinfer_fn.Params, got {type(params).__name__}")
    max_new_tokens = kwargs.pop("max_new_tokens")
    lengths = kwargs.pop("lengths", None)
    tokens, lengths = check_prompts(tokens, lengths, params.config, max_new_tokens,
                                    kwargs.get("max_len"))
    kwargs["stop_tokens"] = check_stop_tokens(kwargs.get("stop_tokens", ()), params.config)
    yield from _generate_blocks(params, tokens, lengths, max_new_tokens=int(max_new_tokens),
                                block=max(1, int(block)), **kwargs)


def _generate_blocks(params, tokens, lengths, *, max_new_tokens, block, temperature=0.0,
                     top_k=None, top_p=None, min_p=None, seed=0, stop_tokens=(),
                     return_logprobs=False, pad_id=None, prefill_chunk=512, max_len=None,
                     window_slots=None, constraint=None, tokenizer=None):
    from deepinfer_fn.api import mesh_context, pad_batch
    cfg = params.config
    B = tokens.shape[0]
    constrained = None
    if constraint is not None:  # compiled per request on the host; a bad grammar fails its row
        constrained = structured.ConstrainedBatch.build(
            constraint, B, structured.default_tokenizer() if tokenizer is None else tokenizer,
            cfg.vocab_size)
    mesh, _ = mesh_context(params)
    if mesh is not None:  # pad the batch to the mesh's batch shards with 1-token dummy rows
        from shardings.mesh import batch_shards, state_shardings
        shards = batch_shards(mesh)
        tokens, lengths = pad_batch(tokens, shards), pad_batch(lengths, shards, fill=1)
        per_row = lambda v: v if np.ndim(v) == 0 or v is None else pad_batch(np.asarray(v), shards, np.asarray(v)[0])
        temperature, top_k, top_p, min_p, seed = map(per_row, (temperature, top_k, top_p, min_p, seed))
    Bp = tokens.shape[0]
    sampling = sampling_params(Bp, temperature, top_k, top_p, min_p, seed)
    need = int(lengths.max()) + max_new_tokens
    capacity = max_len or min(_bucket(need), cfg.max_position_embeddings)
    state = init_state(cfg, Bp, capacity, window_slots=window_slots, dtype=params.dtype)
    if mesh is not None:
        state = jax.device_put(state, state_shardings(state, mesh))
    with mesh_context(params)[1]:
        logits, state = prefill(params, state, tokens, lengths, prefill_chunk)
    pad = jnp.int32(cfg.eos_token_id if pad_id is None else pad_id)
    done = jnp.arange(Bp) >= B  # mesh padding rows never decode
    if constrained is not None:
        yield from _constrained_blocks(params, state, logits, done, sampling, pad, constrained,
                                       B=B, max_new_tokens=max_new_tokens, block=block,
                                       stop_tokens=stop_tokens, return_logprobs=return_logprobs)
        return
    produced = 0
    while produced < max_new_tokens:
        n = min(block, max_new_tokens - produced)
        last = produced + n >= max_new_tokens
        with mesh_context(params)[1]:
            out, logp, count, state, logits, done = _decode_block(
                params, state, logits, done, sampling, pad, n=n, stop_tokens=stop_tokens,
                feed_last=not last)
        produced += n
        yield GenerateOutput(out[:B], count[:B], done[:B], logp[:B] if return_logprobs else None)
        if last or bool(jnp.all(done[:B])):
            return


def _constrained_blocks(params, state, logits, done, sampling, pad, constrained, *, B,
                        max_new_tokens, block, stop_tokens, return_logprobs):
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
                    params, state, logits, done, sampling, pad, masks, sid, n=n,
                    stop_tokens=stop_tokens, feed_last=not last)
            produced += n
            done_host = np.asarray(done)[:B]  # waits for the block: the matchers are up to date
            final = last or bool(done_host.all())
            status = tuple(st if st is None or final or done_host[b] else "pending"
                           for b, st in enumerate(constrained.statuses()[:B]))
            yield GenerateOutput(out[:B], count[:B], done[:B],
                                 logp[:B] if return_logprobs else None, status)
            if final:
                return
    finally:
        structured.unregister(int(sid))
