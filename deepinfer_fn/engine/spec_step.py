"""The speculative engine's jitted sub-steps (spec/dspark.md §2, §3; the engine side of
`generate(..., speculative=...)`).

`spec_decode_packed`: ONE device call for a decode sub-batch of Db slots. Per row, with
P = `spec["length"][slot]` (the anchor's position; the target state holds 0..P-1), the anchor
`last_token[slot]`, the budget `left` and the request-local step counter `step`, all read on
the device (the host never needs a row's exact position to build a step):

1. draft: DSpark (`dspark.draft` from the slot's context rings: γ drafts, q, confidences) or
   MTP (`mtp.draft`: catch up on the pending committed positions, then a chain of k drafts);
2. verify length: cap = clip(left - 1, 0, γ) (the step never emits past max_new_tokens);
   "fixed" -> ell = cap; "dynamic" (DSpark) -> `schedule.padded_verify_len` from the
   confidences and the VerifyCost profile at this sub-batch's bucket size (a traced flag:
   fixed and dynamic engines of the same shapes share one program); the forward runs on
   1 + max(ell) columns rounded up to a compiled width (`schedule.run_with_columns`);
3. the target verify forward on [anchor, drafts] (all logits; DSpark taps / MTP streams)
   against the paged state (`step.gather_state` / `step.scatter_state`, positions P..P+ell);
4. `spec.verify` (greedy match or standard speculative sampling with the ACCEPT / FINAL keys
   of (seed, step)): g accepted, n_emit = g + 1 tokens;
5. rollback = the committed length moves to P + n_emit (rings are position-addressed; the
   engine's window_slots >= sliding_window + γ); the drafter gets the committed positions
   (DSpark: `dspark.push` of their tapped features; MTP: they become the pending catch-up
   inputs of the next step); last_token = the new anchor; left -= n_emit; step += 1.

Output int32 [Db, 2K + 4] (K = γ + 1): tokens, logprob f32 bits, n_emit, g, ell, new length.
Rows with left = 0 (and padding rows) are inactive: nothing is written, n_emit = 0.

`spec_prefill_packed`: a prefill sub-batch (the plain sub-step's forward and sampling) that also
fills the drafter state of its slots: DSpark pushes the chunk's tapped features into the context
rings (as `generate._dspark_prefill_chunk`); MTP runs the MTP block over the chunk's positions
whose next token is known, keeping the last one pending (as `generate._spec_prefill_chunk`). On
a row's final chunk (SPEC_COLUMNS init = 1) it initialises the slot's speculative counters:
length = end of the chunk, left / step from the host, anchor = the sampled token (or the resume
anchor the host passes after a preemption).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from deepinfer_fn import speculative as spec
from deepinfer_fn.engine.paged_state import PagedState
from deepinfer_fn.engine.step import (gather_state, sample_rows, scatter_state, unpack,
                                      unpack_sampling)
from deepinfer_fn.model import transformer
from deepinfer_fn.state import DecodeState


def _take(x, slot):
    return jnp.take(x, slot, axis=0, mode="clip")


def _put(x, slot, value):
    return x.at[slot].set(value.astype(x.dtype), mode="drop")


def _gather_ring(ring: dict, slot, reset=None) -> dict:
    out = {k: _take(v, slot) for k, v in ring.items()}
    if reset is not None:
        out["window_pos"] = jnp.where(reset[:, None], -1, out["window_pos"])
    return out


def _scatter_ring(ring: dict, new: dict, slot) -> dict:
    return {k: _put(v, slot, new[k]) for k, v in ring.items()}


def _where_rows(cond, a, b):
    return jnp.where(cond.reshape(cond.shape + (1,) * (a.ndim - 1)), a, b)


# --- prefill --------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("method",), donate_argnums=(2,))
def spec_prefill_packed(params, drafter, state: PagedState, packed, *, method: str):
    """A prefill sub-batch of a speculative engine (module docstring). packed as
    `step.substep_packed` (with the prefill tokens); drafter: the DSpark (method "dspark") or
    None ("mtp"). Returns (state, out int32 [B, 2] = (sampled token, logprob f32 bits))."""
    cfg = params.config
    meta, fparams, bt, toks = unpack(packed, state.max_pages)
    sc = packed[:, 10:14]
    slot, start, n_new, row_floor, fresh = (meta[:, i] for i in range(5))
    reset = fresh > 0
    S = toks.shape[1]
    sp = dict(state.spec)
    tstate = gather_state(state, slot, start, fresh, bt)
    if method == "dspark":
        dcfg = drafter.config
        logits, new, _, feats = transformer.forward_chunk(
            params, tstate, toks, n_new, row_floor=row_floor, taps=dcfg.target_layer_ids,
            tap=dcfg.tap)
        rings = tuple(_gather_ring(r, slot, reset) for r in sp["draft"])
        ds = DecodeState(rings, start, state.max_len, dcfg.window)
        ds = spec.dspark.push(drafter, cfg, ds, feats, n_new)
        sp["draft"] = tuple(_scatter_ring(r, n, slot) for r, n in zip(sp["draft"], ds.layers))
    else:
        logits, new, streams = transformer.forward_chunk(params, tstate, toks, n_new,
                                                         row_floor=row_floor)
        # The MTP at position i reads the streams at i and the token at i+1. Entries: the
        # pending position start-1 (pend_n = 1; none on a fresh slot) then the chunk's
        # positions; the chunk's last position stays pending (its next token comes later).
        pend_n = jnp.where(reset, 0, _take(sp["pend_n"], slot))
        pend = _take(sp["pend_streams"], slot)
        both = jnp.concatenate([pend[:, :1], streams], axis=1)                # [B,S+1,n,D]
        nxt = jnp.concatenate([toks, jnp.zeros_like(toks[:, :1])], axis=1)    # [B,S+1]
        idx = jnp.clip(jnp.arange(S + 1)[None] + (1 - pend_n)[:, None], 0, S)
        ring = _gather_ring(sp["mtp"], slot, reset)
        ms = DecodeState((ring,), start - pend_n, state.max_len, state.window_slots)
        n_mtp = jnp.where(n_new > 0, n_new - 1 + pend_n, 0)
        _, ms, _ = spec.mtp_chunk(params, ms, jnp.take_along_axis(both, idx[:, :, None, None], 1),
                                  jnp.take_along_axis(nxt, idx, 1), n_mtp)
        last = jnp.clip(n_new - 1, 0, S - 1)
        last_streams = jnp.take_along_axis(streams, last[:, None, None, None], 1)[:, 0]
        live = n_new > 0
        pend = pend.at[:, 0].set(_where_rows(live, last_streams, pend[:, 0]))
        sp["mtp"] = _scatter_ring(sp["mtp"], ms.layers[0], slot)
        sp["pend_streams"] = _put(sp["pend_streams"], slot, pend)
        sp["pend_n"] = _put(sp["pend_n"], slot, jnp.where(live, 1, pend_n))
    state = scatter_state(state, new, slot, bt, start, n_new, row_floor, S)
    sampled, logp = sample_rows(logits, unpack_sampling(meta, fparams), start + n_new)
    anchor = jnp.where(sc[:, 3] >= 0, sc[:, 3], sampled)
    init = jnp.where(sc[:, 0] > 0, slot, state.max_batch)         # final chunks only
    sp["length"] = _put(sp["length"], init, start + n_new)
    sp["left"] = _put(sp["left"], init, sc[:, 1])
    sp["step"] = _put(sp["step"], init, sc[:, 2])
    if method == "mtp":
        ids = jnp.zeros((slot.shape[0], sp["pend_ids"].shape[1]), jnp.int32)
        sp["pend_ids"] = _put(sp["pend_ids"], init, ids.at[:, 0].set(anchor))
    state = dataclasses.replace(state, spec=sp,
                                last_token=_put(state.last_token, slot, anchor))
    out = jnp.stack([sampled, jax.lax.bitcast_convert_type(logp, jnp.int32)], axis=1)
    return state, out


# --- decode (draft -> verify -> accept -> rollback -> drafter update) -----------------------


def schedule_args(drafter, verify_len: str, verify_cost, batch: int, widths=None):
    """(sched, widths) for a DSpark engine's decode step at a bucket of `batch` rows. sched =
    (STS temperatures [γ], step seconds [γ+1] as the compiled widths cost them
    (`schedule.bucketed_seconds`), overhead, eps, dynamic flag); "fixed": placeholders with the
    flag off. widths: the given ones, else (γ+1,) for "fixed" and, for "dynamic", the widths
    where the profile gets cheaper (`schedule.column_buckets`, as generate compiles them)."""
    from deepinfer_fn.generate import _dspark_schedule_args
    from deepinfer_fn.speculative.schedule import bucketed_seconds
    g = drafter.config.block_size
    if verify_len == "fixed":
        return ((drafter.sts_temperatures.astype(jnp.float32), jnp.ones((g + 1,), jnp.float32),
                 jnp.float32(0), jnp.float32(0), jnp.bool_(False)),
                tuple(widths) if widths else (g + 1,))
    (temps, secs, overhead, eps, dynamic), auto = _dspark_schedule_args(
        drafter, verify_len, verify_cost, batch)
    if widths and tuple(widths) != tuple(auto):
        raw = verify_cost.step_seconds_for(batch)
        secs = jnp.asarray(bucketed_seconds(raw, widths).astype("float32"))
    return (temps, secs, overhead, eps, dynamic), tuple(widths or auto)


@functools.partial(jax.jit, static_argnames=("method", "k", "widths"), donate_argnums=(2,))
def spec_decode_packed(params, drafter, state: PagedState, packed, sched, *, method: str,
                       k: int, widths: tuple[int, ...]):
    """One speculative decode sub-batch (module docstring). packed int32 [Db, PACK_HEAD +
    max_pages] (`Scheduler.pack` of decode rows); drafter: DSpark or None (MTP); sched:
    `schedule_args` (DSpark) or None (MTP: fixed); k = γ (drafts per step); widths: the verify
    column counts compiled, ascending, ending at k + 1 (`schedule.run_with_columns`). Returns (state, out int32
    [Db, 2(k+1) + 4])."""
    from deepinfer_fn.speculative import schedule

    cfg = params.config
    meta, fparams, bt, _ = unpack(packed, state.max_pages)
    slot, row_floor = meta[:, 0], meta[:, 3]
    sampling = unpack_sampling(meta, fparams)
    sp = dict(state.spec)
    P, left, step = _take(sp["length"], slot), _take(sp["left"], slot), _take(sp["step"], slot)
    active = (slot < state.max_batch) & (left > 0)
    anchor = _take(state.last_token, slot)
    cap = jnp.where(active, jnp.clip(left - 1, 0, k), 0)
    K = k + 1
    if method == "dspark":
        dcfg = drafter.config
        ds = DecodeState(tuple(_gather_ring(r, slot) for r in sp["draft"]), P, state.max_len,
                         dcfg.window)
        drafts, q, conf = spec.dspark.draft(drafter, params, ds, anchor, sampling, step)
        temps, secs, overhead, eps, dynamic = sched
        ell = schedule.padded_verify_len(conf, temps, active, cap, secs, overhead, eps)
        ell = jnp.where(active, jnp.where(dynamic, jnp.clip(ell, 0, cap), cap), 0)
        taps = dict(taps=dcfg.target_layer_ids, tap=dcfg.tap)
    else:
        pend_n = _take(sp["pend_n"], slot)
        ms = DecodeState((_gather_ring(sp["mtp"], slot),), P - pend_n, state.max_len,
                         state.window_slots)
        drafts, q, ms = spec.draft(params, ms, _take(sp["pend_streams"], slot),
                                   _take(sp["pend_ids"], slot), jnp.where(active, pend_n, 0), k,
                                   sampling, step)
        ell = cap
        taps = {}
    ids = jnp.concatenate([anchor[:, None], drafts], axis=1)
    n_new = jnp.where(active, ell + 1, 0)
    tstate = gather_state(state, slot, P, jnp.zeros_like(slot), bt)

    def verify_forward(ids_s):
        out = transformer.forward_chunk(params, tstate, ids_s, n_new, all_logits=True,
                                        row_floor=row_floor, **taps)
        return (out[0], out[2]) + tuple(out[3:]), out[1]

    # the padded forward runs 1 + max(ell) columns (rounded up to a compiled width)
    per_token, new = schedule.run_with_columns(verify_forward, ids,
                                               schedule.verify_columns(ell, active), widths)
    logits, streams = per_token[:2]
    tokens, g = spec.verify(logits, drafts, q, sampling, step, ell)
    n_emit = jnp.where(active, g + 1, 0)
    lp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[..., None], -1)[..., 0]
    state = scatter_state(state, new, slot, bt, P, n_new, row_floor, K)
    if method == "dspark":   # the committed positions' features join the draft context
        ds = spec.dspark.push(drafter, cfg, ds, per_token[2], n_emit)
        sp["draft"] = tuple(_scatter_ring(r, n, slot) for r, n in zip(sp["draft"], ds.layers))
    else:                    # they are the MTP's pending inputs of the next step
        sp["mtp"] = _scatter_ring(sp["mtp"], ms.layers[0], slot)
        keep = lambda new_v, key: _put(sp[key], slot,
                                       _where_rows(active, new_v, _take(sp[key], slot)))
        sp["pend_streams"] = keep(streams.astype(sp["pend_streams"].dtype), "pend_streams")
        sp["pend_ids"] = keep(tokens, "pend_ids")
        sp["pend_n"] = keep(n_emit, "pend_n")
    new_anchor = jnp.take_along_axis(tokens, g[:, None], axis=1)[:, 0]
    sp["length"] = _put(sp["length"], slot, P + n_emit)
    sp["left"] = _put(sp["left"], slot, left - n_emit)
    sp["step"] = _put(sp["step"], slot, step + active.astype(jnp.int32))
    state = dataclasses.replace(
        state, spec=sp, last_token=_put(state.last_token, slot,
                                        jnp.where(active, new_anchor, anchor)))
    out = jnp.concatenate([tokens, jax.lax.bitcast_convert_type(lp, jnp.int32),
                           jnp.stack([n_emit, g, ell, P + n_emit], axis=1)], axis=1)
    return state, out
