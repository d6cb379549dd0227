"""The speculative engine's jitted sub-steps (docs/MODEL.md §D2, §3): the engine's packing
around `speculative.loop.speculative_step` and `Drafter.prefill`, for any registered drafter.

Per slot on the device (`PagedState.spec`, `init_spec_slots`): the committed length `length`
(= the anchor's position P; the target state holds 0..P-1), the token budget `left`, the
request-local verify-step counter `step` (the counter-based draft / accept / final keys) and
the drafter's own state `drafter` (any pytree with the slot axis leading: gathered and
scattered by slot like the rings). The anchor is the slot's `last_token`.

`spec_decode_packed`: ONE device call for a decode sub-batch of Db slots and up to `steps`
verify steps. It gathers the rows' target state (`step.gather_state`, positions P..) and
drafter state once, runs the steps on that contiguous copy (budget = `left`, so the device
never emits past max_new_tokens; verify-length policy "fixed", or "scheduled" for drafters
with a confidence head: `schedule.padded_verify_len` from the confidences and the VerifyCost
profile at this sub-batch's bucket size behind a traced flag, so fixed and dynamic engines
of the same shapes share one program; the verify forward on 1 + max(ell) columns rounded up
to a compiled width), scatters both back once (rollback = the committed length moves to
P + n_emit; the engine's window_slots >= sliding_window + γ) and sets last_token = the new
anchor, left -= n_emit, step += 1 per step.

Output int32 [Db, 2K + 4] (K = γ + 1): tokens, logprob f32 bits, n_emit, g, ell, new length.
Rows with left = 0 (and padding rows) are inactive: nothing is written, n_emit = 0.

`spec_prefill_packed`: a prefill sub-batch (the plain sub-step's forward and sampling) that
also runs `Drafter.prefill` over the chunk (only the chunk is known: a drafter keeps what needs
the next token pending); a fresh slot's drafter state starts empty. With V4.1's decoder SWA
bounded replay (`tail`, static) the forward is `replay_v41.extend` and the drafter sees the
chunk's tail rows only, as in `generate` (`replay_v41.tail_extend`); verify chunks always run
every layer on every row. On a row's final chunk (SPEC_COLUMNS init = 1) it initialises the
slot's speculative counters: length = end of the chunk, left / step from the host, anchor =
the sampled token (or the resume anchor the host passes after a preemption).

On a mesh every read and write of `spec` and `last_token` is shard-local (`step.take_slots` /
`put_slots`), like the rings: the spec state is split by slot over the batch shards.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from deepinfer_fn.engine.paged_state import PagedState
from deepinfer_fn.engine.step import (gather_state, put_slots, sample_rows, scatter_state,
                                      take_slots, unpack, unpack_sampling)
from deepinfer_fn.model import replay_v41, transformer
from deepinfer_fn.program_cache import program
from deepinfer_fn.speculative.drafter import Drafter, target_features
from deepinfer_fn.speculative.loop import VerifyLen, profile_args, speculative_step


def _take(x, slot):
    return take_slots(x, slot)


def _put(x, slot, value):
    return put_slots(x, slot, value)


def _where_rows(cond, a, b):
    return jnp.where(cond.reshape(cond.shape + (1,) * (a.ndim - 1)), a, b)


def init_spec_slots(params, drafter: Drafter, weights, *, max_batch: int, max_len: int,
                    window_slots: int, k: int) -> dict:
    """The `PagedState.spec` dict of a speculative engine: zero counters and an empty drafter
    state per slot."""
    zeros = lambda: jnp.zeros((max_batch,), jnp.int32)
    return {"length": zeros(), "left": zeros(), "step": zeros(),
            "drafter": drafter.init_state(params, weights, max_batch, max_len,
                                          window_slots=window_slots, k=k, dtype=params.dtype)}


def _gather_drafter(tree, slot):
    return take_slots(tree, slot)


def _scatter_drafter(tree, new, slot):
    return put_slots(tree, slot, new)


# --- prefill --------------------------------------------------------------------------------


def _target_prefill(params, weights, tstate, toks, n_new, row_floor, *, drafter: Drafter,
                    tail: int | None):
    """The target's forward over a prefill chunk toks [B, S] with the drafter's taps: (logits
    [B, V], new target state, `Features`, the drafter's prefill view (lengths, ids, n_new) of
    it). tail (V4.1): a decoder-bounded-replay extend, the view its tail rows
    (`replay_v41.tail_extend`, as generate's prefill); None: every layer on every row, the
    view the whole chunk."""
    start = tstate.lengths
    if tail is None:
        logits, new, feats = target_features(transformer.forward_chunk(
            params, tstate, toks, n_new, row_floor=row_floor, **drafter.taps(weights)))
        return logits, new, feats, (start, toks, n_new)
    *out, (at, ids, n_tail, _, _) = replay_v41.tail_extend(
        params, tstate, toks, n_new, tail=tail, row_floor=row_floor, **drafter.taps(weights))
    logits, new, feats = target_features(out)
    return logits, new, feats, (at, ids, n_tail)


@program(static_argnames=("drafter", "k", "tail"), donate_argnums=(2,))
def spec_prefill_packed(params, weights, state: PagedState, packed, *, drafter: Drafter, k: int,
                        tail: int | None = None):
    """A prefill sub-batch of a speculative engine (module docstring). packed as
    `step.substep_packed` (with the prefill tokens); weights: the drafter's (or None); tail:
    V4.1 decoder SWA bounded replay with that many tail rows (`_target_prefill`). Returns
    (state, out int32 [B, 2] = (sampled token, logprob f32 bits))."""
    meta, fparams, bt, toks = unpack(packed, state.max_pages)
    sc = packed[:, 10:14]
    slot, start, n_new, row_floor, fresh = (meta[:, i] for i in range(5))
    sp = dict(state.spec)
    tstate = gather_state(state, slot, start, fresh, bt,
                          pad_id=params.config.engram_pad_token_id)
    logits, new, feats, (at, ids, n_seen) = _target_prefill(
        params, weights, tstate, toks, n_new, row_floor, drafter=drafter, tail=tail)
    empty = drafter.init_state(params, weights, slot.shape[0], state.max_len,
                               window_slots=state.window_slots, k=k, dtype=params.dtype)
    ds = jax.tree.map(lambda e, x: _where_rows(fresh > 0, e, x), empty,
                      _gather_drafter(sp["drafter"], slot))
    ds = drafter.prefill(params, weights, ds, at, feats, ids, n_seen, None, None)
    sp["drafter"] = _scatter_drafter(sp["drafter"], ds, slot)
    state = scatter_state(state, new, slot, bt, start, n_new, row_floor, toks.shape[1])
    sampled, logp = sample_rows(logits, unpack_sampling(meta, fparams), start + n_new)
    anchor = jnp.where(sc[:, 3] >= 0, sc[:, 3], sampled)
    init = jnp.where(sc[:, 0] > 0, slot, state.max_batch)         # final chunks only
    sp["length"] = _put(sp["length"], init, start + n_new)
    sp["left"] = _put(sp["left"], init, sc[:, 1])
    sp["step"] = _put(sp["step"], init, sc[:, 2])
    state = dataclasses.replace(state, spec=sp,
                                last_token=_put(state.last_token, slot, anchor))
    out = jnp.stack([sampled, jax.lax.bitcast_convert_type(logp, jnp.int32)], axis=1)
    return state, out


# --- decode (draft -> verify -> accept -> rollback -> drafter update) -----------------------


def schedule_args(drafter: Drafter, weights, k: int, verify_len: str, verify_cost, batch: int,
                  widths=None):
    """(VerifyLen, sched) of a speculative engine's decode step at a bucket of `batch` rows.
    Drafters without a confidence head: "fixed", widths = the given ones or (k+1,), no sched.
    With one: "scheduled", sched = (STS temperatures [k], step seconds [k+1] as the compiled
    widths cost them, overhead, eps, dynamic flag); verify_len "fixed": placeholders with the
    flag off and widths (k+1,) unless given; "dynamic": `loop.profile_args` (widths: the given
    ones, else where the profile gets cheaper, as generate compiles them)."""
    if verify_len == "dynamic":
        sched, widths = profile_args(drafter, weights, k, verify_cost, batch, dynamic=True,
                                     widths=widths)
        return VerifyLen("scheduled", tuple(widths)), sched
    widths = tuple(widths) if widths else (k + 1,)
    if not drafter.confidence:
        return VerifyLen("fixed", widths), None
    return VerifyLen("scheduled", widths), (
        drafter.sts_temperatures(weights), jnp.ones((k + 1,), jnp.float32), jnp.float32(0),
        jnp.float32(0), jnp.bool_(False))


def _step_out(o, P):
    """One verify step's output columns: tokens, logprob f32 bits, n_emit, g, ell, new length."""
    return jnp.concatenate([o.tokens, jax.lax.bitcast_convert_type(o.logprobs, jnp.int32),
                            jnp.stack([o.n_emit, o.g, o.ell, P + o.n_emit], axis=1)], axis=1)


@program(static_argnames=("drafter", "k", "verify_len", "steps",
                                             "fixed_trips"), donate_argnums=(2,))
def spec_decode_packed(params, weights, state: PagedState, packed, sched, *, drafter: Drafter,
                       k: int, verify_len: VerifyLen, steps: int = 1, fixed_trips: bool = False):
    """Up to `steps` speculative decode steps of a sub-batch in one device call (module
    docstring). packed int32 [Db, PACK_HEAD + max_pages] (`Scheduler.pack` of decode rows; its
    n_new column: each row's step count n_b <= steps); weights: the drafter's (or None); sched
    and verify_len: `schedule_args`; k = γ (drafts per step). Step i runs the rows with n_b > i
    (and budget left); the loop runs max(n_b) iterations, or with fixed_trips exactly `steps`
    (as `step.decode_steps_packed`). The rows' target and drafter state is gathered once
    before the loop and scattered once after it (the pages of every position a verify chunk
    wrote); a row that does not step keeps everything (`speculative_step`). Returns (state,
    out int32 [Db, steps, 2(k+1) + 4]); entries of steps a row did not run are zero
    (n_emit = 0)."""
    assert steps >= 1, steps
    meta, fparams, bt, _ = unpack(packed, state.max_pages)
    slot, row_floor = meta[:, 0], meta[:, 3]
    n_steps = meta[:, 2]
    sampling = unpack_sampling(meta, fparams)
    sp = dict(state.spec)
    P0, left0, step0 = _take(sp["length"], slot), _take(sp["left"], slot), _take(sp["step"], slot)
    real = slot < state.max_batch
    tstate = gather_state(state, slot, P0, jnp.zeros_like(slot), bt,
                          pad_id=params.config.engram_pad_token_id)
    width = 2 * (k + 1) + 4

    def body(i, carry):
        tstate, dstate, anchor, left, step, written, out = carry
        P = tstate.lengths
        runs = i < n_steps
        active = real & runs & (left > 0)
        o = speculative_step(params, drafter, weights, tstate, dstate, anchor, sampling, step,
                             active, left, k=k, verify_len=verify_len, sched=sched,
                             row_floor=row_floor)
        written = jnp.where(active, jnp.maximum(written, P + o.ell + 1), written)
        step_out = jnp.where(runs[:, None], _step_out(o, P), 0)
        out = jax.lax.dynamic_update_slice(out, step_out[:, None], (0, i, 0))
        return (o.state, o.dstate, o.anchor, left - o.n_emit,
                step + active.astype(jnp.int32), written, out)

    carry = (tstate, _gather_drafter(sp["drafter"], slot), _take(state.last_token, slot),
             left0, step0, P0, jnp.zeros((meta.shape[0], steps, width), jnp.int32))
    if steps == 1:
        carry = body(0, carry)
    else:
        trips = steps if fixed_trips else jnp.minimum(jnp.max(n_steps), steps)
        carry = jax.lax.fori_loop(0, trips, body, carry)
    tstate, dstate, anchor, left, step, written, out = carry
    state = scatter_state(state, tstate, slot, bt, P0, written - P0, row_floor, steps * (k + 1))
    sp["drafter"] = _scatter_drafter(sp["drafter"], dstate, slot)
    sp["length"] = _put(sp["length"], slot, tstate.lengths)
    sp["left"] = _put(sp["left"], slot, left)
    sp["step"] = _put(sp["step"], slot, step)
    state = dataclasses.replace(state, spec=sp,
                                last_token=_put(state.last_token, slot, anchor))
    return state, out
