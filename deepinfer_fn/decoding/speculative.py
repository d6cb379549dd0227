"""Speculative decoding in `generate` / `stream_generate`: prefill, then a device-side
`lax.while_loop` of `speculative.loop.speculative_step` for any registered drafter.

A run: the target's chunked prefill with the drafter's (`Drafter.prefill` after every chunk,
the prompt's continuation known on the host; with V4.1's decoder SWA bounded replay the target
chunk is a `replay_v41.extend` and the drafter sees the chunk's tail rows only, the last
sliding_window positions, all that its window context holds); the first token sampled from
the prefill logits as plain decoding does; then segments of the while-loop, each running the
rows short of a token target (`generate`: one segment to the end; `stream_generate`: one per
block). A row that reaches the target waits without taking steps (no key consumed), so its
tokens are those of `generate`. With a constraint, the rows' matchers are registered for the
host callbacks for the run's lifetime (`structured.register`); drafts are drawn under the
grammar masks and verified against the masked target, and a constraint that fails to compile
ends its row alone.

The loop carry: the target state, the drafter state, the anchor (last committed token), the
output buffers out / logp [B, n + k + 1] and count / done / step per row, the per-step
histories acc / ver (-1 where a row ran no such step) and, for drafters with a confidence
head, conf [B, n, k]; constrained: masks (m_0) and ended.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from deepinfer_fn import bundle, structured
from deepinfer_fn.api import mesh_context
from deepinfer_fn.decoding.output import GenerateOutput
from deepinfer_fn.decoding.prefill import bucket, keep_last, prefill_chunks
from deepinfer_fn.decoding.rows import mesh_rows, on_mesh, replicated, rows_per_device
from deepinfer_fn.model import replay_v41, transformer
from deepinfer_fn.params import Params
from deepinfer_fn.sampling import SamplingParams, sample
from deepinfer_fn.speculative import registry
from deepinfer_fn.speculative.drafter import Drafter, target_features
from deepinfer_fn.speculative.loop import VerifyLen, speculative_step, verify_policy
from deepinfer_fn.state import DecodeState, init_state


# --- prefill ---------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("drafter", "bounded_replay"), donate_argnums=(2, 3))
def spec_prefill_chunk(params: Params, weights, state: DecodeState, dstate, chunk, next_ids,
                       n_new, n_next, *, drafter: Drafter, bounded_replay: bool = False):
    """A target prefill chunk [B,c] (with the drafter's taps), then `drafter.prefill` over it;
    next_ids [B,c]: the token after each position, known for the first n_next [B] of them.
    bounded_replay (V4.1): the chunk is a decoder-bounded-replay extend and the drafter gets
    its tail rows (`replay_v41.tail_extend`): positions start + first .. start + n_new - 1.
    Returns (last-token logits [B,V], state, dstate)."""
    start = state.lengths
    if not bounded_replay:
        logits, state, feats = target_features(transformer.forward_chunk(
            params, state, chunk, n_new, **drafter.taps(weights)))
        dstate = drafter.prefill(params, weights, dstate, start, feats, chunk, n_new, next_ids,
                                 n_next)
        return logits, state, dstate
    *out, (at, ids, n_tail, nxt, n_nxt) = replay_v41.tail_extend(
        params, state, chunk, n_new, next_ids, n_next, **drafter.taps(weights))
    logits, state, feats = target_features(out)
    dstate = drafter.prefill(params, weights, dstate, at, feats, ids, n_tail, nxt, n_nxt)
    return logits, state, dstate


def spec_prefill(params, drafter: Drafter, weights, state, dstate, tokens, lengths, chunk, *,
                 bounded_replay: bool = False):
    """`prefill.prefill` with the drafter's: the target reaches lengths, the drafter has seen
    every prompt position (the last one's next token is the first generated one; with
    bounded_replay the last sliding_window of each chunk)."""
    last = None
    for ids, next_ids, n_new, ends_here in prefill_chunks(tokens, lengths, chunk):
        n_next = n_new - ends_here.astype(np.int32)     # positions whose next token is known
        logits, state, dstate = spec_prefill_chunk(
            params, weights, state, dstate, ids, jnp.asarray(next_ids), jnp.asarray(n_new),
            jnp.asarray(n_next), drafter=drafter, bounded_replay=bounded_replay)
        last = keep_last(last, logits, ends_here)
    return last, state, dstate


# --- the loop --------------------------------------------------------------------------------


def _stops(stop_tokens: tuple[int, ...]) -> jax.Array:
    return jnp.asarray(stop_tokens if stop_tokens else (-1,), jnp.int32)


def _first_token(logits, sampling, lengths, done, masks, session, pad_id, stops, *, n: int,
                 width: int):
    """The first generated token, sampled from the prefill logits as plain decoding does
    (under `masks`, then consumed by the host matchers, when constrained). Returns (first [B],
    out [B,width], logp [B,width], count [B], done [B], masks, ended [B]): the output buffers
    with the first token written, and the rows the constraint finished."""
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


def _record(hist, step, active, value):
    """hist [B, n, ...] with value [B, ...] written at each active row's own step index
    (an active row's step is < n: every step commits at least one of its n tokens)."""
    rows, at = jnp.arange(hist.shape[0]), jnp.minimum(step, hist.shape[1] - 1)
    keep = active.reshape((-1,) + (1,) * (hist.ndim - 2))
    return hist.at[rows, at].set(jnp.where(keep, value.astype(hist.dtype), hist[rows, at]))


def _runnable(carry, until):
    """Rows that take a step in this segment: not done and short of `until` tokens."""
    return ~carry["done"] & (carry["count"] < until)


@functools.partial(jax.jit, static_argnames=("n", "k", "stop_tokens", "confidence"),
                   donate_argnums=(0, 1))
def spec_start(state: DecodeState, dstate, logits, done, sampling: SamplingParams, pad_id,
               masks=None, session=None, *, n: int, k: int, stop_tokens: tuple[int, ...],
               confidence: bool) -> dict:
    """The loop carry (module docstring) after the first token, which is the first anchor."""
    first, out, logp, count, done, masks, ended = _first_token(
        logits, sampling, state.lengths, done, masks, session, pad_id, _stops(stop_tokens), n=n,
        width=n + k + 1)
    B = count.shape[0]
    hist = jnp.full((B, n), -1, jnp.int32)
    carry = dict(state=state, dstate=dstate, anchor=first, out=out, logp=logp, count=count,
                 done=done, step=jnp.zeros((B,), jnp.int32), acc=hist, ver=hist, ended=ended)
    if confidence:
        carry["conf"] = jnp.zeros((B, n, k), jnp.float32)
    if masks is not None:
        carry["masks"] = masks
    return carry


@functools.partial(jax.jit, static_argnames=("drafter", "n", "k", "stop_tokens", "verify_len"),
                   donate_argnums=(2,))
def spec_steps(params: Params, weights, carry: dict, sampling: SamplingParams, sched, until,
               session=None, *, drafter: Drafter, n: int, k: int, stop_tokens: tuple[int, ...],
               verify_len: VerifyLen) -> dict:
    """`lax.while_loop` of speculative steps until every row is done or has `until` tokens
    (rows past it wait: no step, no key consumed; `until` = n runs to the end). Each step's
    emitted tokens (truncated after a stop token) go to out / logp at the row's count."""
    constrained = "masks" in carry
    stops = _stops(stop_tokens)

    def body(c):
        active = _runnable(c, until)
        count, step = c["count"], c["step"]
        o = speculative_step(params, drafter, weights, c["state"], c["dstate"], c["anchor"],
                             sampling, step, active, n - count, k=k, verify_len=verify_len,
                             sched=sched, stops=stops,
                             constraint=(c["masks"], session) if constrained else None)
        B, K = o.tokens.shape
        j = jnp.arange(K)[None]
        rows = jnp.arange(B)[:, None]
        idx = jnp.where(j < o.n_out[:, None], count[:, None] + j, c["out"].shape[1])
        count = count + o.n_out
        new = dict(c, state=o.state, dstate=o.dstate, anchor=o.anchor,
                   out=c["out"].at[rows, idx].set(o.tokens, mode="drop"),
                   logp=c["logp"].at[rows, idx].set(o.logprobs, mode="drop"), count=count,
                   done=c["done"] | o.hit | (count >= n), step=step + active.astype(jnp.int32),
                   acc=_record(c["acc"], step, active, o.g),
                   ver=_record(c["ver"], step, active, o.ell))
        if "conf" in c:
            new["conf"] = _record(c["conf"], step, active, o.confidence)
        if constrained:
            new["masks"], new["ended"] = o.masks, c["ended"] | o.ended
        return new

    return jax.lax.while_loop(lambda c: jnp.any(_runnable(c, until)), body, carry)


@functools.partial(jax.jit, static_argnames=("stop_tokens",))
def _stopped(out, count, ended, *, stop_tokens: tuple[int, ...]):
    """bool [B]: rows that ended right after a stop token, or that their constraint ended."""
    last = jnp.take_along_axis(out, jnp.maximum(count - 1, 0)[:, None], 1)[:, 0]
    return ((count > 0) & jnp.isin(last, _stops(stop_tokens))) | ended


# --- segments --------------------------------------------------------------------------------


@dataclasses.dataclass
class Segment:
    """One segment of a speculative run: the loop carry (device arrays, mesh padding rows
    included), the number of real rows, stopped bool [rows+padding], statuses."""
    carry: dict
    rows: int
    stopped: jax.Array
    statuses: tuple | None


def _segments(carry, advance, *, n: int, block: int, stop_tokens, B: int, constrained=None,
              failed=None):
    """Yields a `Segment` after `advance(carry, until)` for until = block, 2 block, ... n
    (ends early once every row is done); the constraint's statuses are "pending" for the
    rows still running in a segment that is not the last."""
    until = 0
    while True:
        until = min(until + block, n)
        carry = advance(carry, jnp.int32(until))
        stopped = _stopped(carry["out"], carry["count"], carry["ended"], stop_tokens=stop_tokens)
        # the last segment does not wait for the device (unless the matchers must be read)
        final = until >= n or bool(np.asarray(carry["done"])[:B].all())
        statuses = None
        if constrained is not None:   # waits for the loop: the matchers are up to date
            done = np.asarray(carry["done"])[:B]
            stopped = jnp.asarray(np.asarray(stopped) | failed)
            statuses = tuple(st if st is None or final or done[b] else "pending"
                             for b, st in enumerate(constrained.statuses()[:B]))
        yield Segment(carry, B, stopped, statuses)
        if final:
            return


def speculative_run(params, tokens, lengths, *, method: str, k, max_new_tokens: int,
                    block: int, temperature, top_k, top_p, min_p, seed, stop_tokens, pad_id,
                    prefill_chunk, max_len, window_slots, constraint=None, tokenizer=None,
                    drafter=None, verify_len="fixed", verify_cost=None, bounded_replay=False):
    """Generator of `Segment`s of a speculative run (module docstring; the arguments are
    generate's, checked by `checks`; the drafter's own checks happen at the first step).
    method: a `speculative.registry` name; drafter: that drafter's weights (DSpark), or None;
    k: num_draft_tokens; bounded_replay: the resolved decoder_swa_bounded_replay."""
    cfg = params.config
    kind = registry.get(method)
    weights, k = kind.resolve(params, drafter, k)
    B = tokens.shape[0]
    mesh, tokens, lengths, sampling = mesh_rows(params, tokens, lengths, temperature, top_k,
                                                top_p, min_p, seed)
    Bp = tokens.shape[0]
    # a sharded verify forward processes Bp / (batch shards) rows per device
    verify, sched = verify_policy(kind, weights, k, verify_len, verify_cost,
                                  rows_per_device(mesh, Bp))
    constrained = None
    if constraint is not None:  # compiled per request on the host; a bad grammar fails its row
        constrained = structured.ConstrainedBatch.build(
            constraint, B, bundle.constraint_tokenizer(params, tokenizer),
            cfg.vocab_size)
    capacity = max_len or min(bucket(int(lengths.max()) + max_new_tokens + k + 1),
                              cfg.max_position_embeddings)
    # Rejected drafts must not overwrite live ring entries: sliding_window + k slots.
    slots = max(window_slots or 0, cfg.sliding_window + k)
    state = on_mesh(init_state(cfg, Bp, capacity, window_slots=slots, dtype=params.dtype), mesh)
    dstate = on_mesh(kind.init_state(params, weights, Bp, capacity, window_slots=slots, k=k,
                                     dtype=params.dtype), mesh)
    weights = replicated(weights, mesh)      # a drafter is small: a full copy on every device
    with mesh_context(params)[1]:
        logits, state, dstate = spec_prefill(params, kind, weights, state, dstate, tokens,
                                             lengths, prefill_chunk,
                                             bounded_replay=bounded_replay)
    pad = jnp.int32(cfg.eos_token_id if pad_id is None else pad_id)
    done = jnp.arange(Bp) >= B  # mesh padding rows never decode
    masks = sid = failed = None
    if constrained is not None:
        constrained.pad_rows(Bp)
        masks, failed = constrained.initial()
        done, masks = done | jnp.asarray(failed), jnp.asarray(masks)
        sid = jnp.int32(structured.register(constrained))

    def advance(carry, until):
        with mesh_context(params)[1]:
            return spec_steps(params, weights, carry, sampling, sched, until, sid, drafter=kind,
                              n=max_new_tokens, k=k, stop_tokens=stop_tokens, verify_len=verify)

    try:
        with mesh_context(params)[1]:
            carry = spec_start(state, dstate, logits, done, sampling, pad, masks, sid,
                               n=max_new_tokens, k=k, stop_tokens=stop_tokens,
                               confidence=kind.confidence)
        yield from _segments(carry, advance, n=max_new_tokens, block=block,
                             stop_tokens=stop_tokens, B=B, constrained=constrained,
                             failed=failed)
    finally:
        if sid is not None:
            structured.unregister(int(sid))


def speculative_output(runs, *, max_new_tokens: int, return_logprobs: bool) -> GenerateOutput:
    """`generate(..., speculative=...)`: the last segment of a one-segment run as an output."""
    for seg in runs:
        pass
    c, B, n = seg.carry, seg.rows, max_new_tokens
    return GenerateOutput(c["out"][:B, :n], c["count"][:B], seg.stopped[:B],
                          c["logp"][:B, :n] if return_logprobs else None, seg.statuses,
                          accepted=c["acc"][:B], verified=c["ver"][:B],
                          draft_confidence=c["conf"][:B] if "conf" in c else None)


def speculative_pieces(runs, *, pad_id, return_logprobs):
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
