"""One speculative step for any `Drafter` (docs/MODEL.md §D2, §3), and its verify-length policy.

`speculative_step` is the whole step, used by `generate`'s while-loop
(`deepinfer_fn.decoding.speculative`) and by the engine's sub-step
(`deepinfer_fn.engine.spec_step`), which only differ in where the rows' states live:

1. draft: `drafter.draft` proposes k tokens after each row's anchor (under the grammar
   masks m_0..m_{k-1} when constrained; slots after a drafted EOS / dead end are not admitted);
2. verify length ell [B] <= cap = clip(budget - 1, 0, k) (a step never emits past the row's
   budget): the `VerifyLen` policy, "fixed" (ell = cap), "random" (uniform in 0..cap per row
   and step, a losslessness diagnostic) or "scheduled" (`schedule.padded_verify_len` from the
   drafter's confidences and a verify-cost profile, behind a traced on/off flag so fixed and
   dynamic runs share one program);
3. one target forward over [anchor, drafts] (all logits, the drafter's taps), on 1 + max(ell)
   columns rounded up to a compiled width when the policy has widths
   (`schedule.run_with_columns`); constrained: the logits masked by m_0..m_k;
4. `verify.verify`: greedy match or standard speculative sampling (lossless), g accepted,
   n_emit = g + 1 tokens; emitted tokens truncated after a stop token; constrained: the
   `host_commit` callback rolls the matchers back to the accepted drafts;
5. rollback: the target state keeps lengths + n_emit (its rings are position-addressed);
   `drafter.commit` feeds the drafter the committed positions; the anchor moves to the last
   emitted token.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from deepinfer_fn import structured
from deepinfer_fn.errors import ArgumentError
from deepinfer_fn.model import transformer
from deepinfer_fn.sampling import Role, request_key
from deepinfer_fn.speculative import schedule
from deepinfer_fn.speculative.drafter import Drafter, target_features
from deepinfer_fn.speculative.verify import rollback, verify

VERIFY_MODES = ("fixed", "random", "scheduled")


@dataclasses.dataclass(frozen=True)
class VerifyLen:
    """The verify-length policy of a compiled step (static): mode (`VERIFY_MODES`) and
    widths, the verify forward's compiled column counts (ascending, ending at k + 1; None:
    every width for "random" / "scheduled", the full width for "fixed")."""

    mode: str = "fixed"
    widths: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.mode not in VERIFY_MODES:
            raise ValueError(f"VerifyLen.mode must be one of {VERIFY_MODES}, got {self.mode!r}")


class StepOut(NamedTuple):
    """One step's result per row (K = k + 1): tokens int32 [B,K] (the g accepted drafts then
    the correction / bonus token), g [B], n_emit [B] = g + 1 for active rows (0 otherwise:
    what the states keep), n_out [B] (tokens to report: n_emit truncated after a stop token
    or by the grammar), hit bool [B] (a stop token or the grammar ended the row), ell [B]
    (drafts verified), logprobs f32 [B,K] (of the, possibly masked, target logits),
    confidence f32 [B,k] or None; state (the target's, at lengths + n_emit), dstate, anchor
    [B]; constrained: masks uint32 [B,W] (the next m_0) and ended bool [B], else None."""

    tokens: jax.Array
    g: jax.Array
    n_emit: jax.Array
    n_out: jax.Array
    hit: jax.Array
    ell: jax.Array
    logprobs: jax.Array
    confidence: jax.Array | None
    state: object
    dstate: object
    anchor: jax.Array
    masks: jax.Array | None = None
    ended: jax.Array | None = None


def verify_lengths(confidence, active, cap, verify_len: VerifyLen, sched, seed, step, k: int):
    """ell [B] in 0..cap under the policy (module docstring, 2.). sched: the "scheduled"
    mode's (STS temperatures [k], step seconds [k+1], overhead, eps, dynamic flag); the
    "random" mode's key is the DRAFT stream at slot k, which no draft uses."""
    if verify_len.mode == "fixed":
        return cap
    if verify_len.mode == "random":
        keys = request_key(seed, None, step=step, slot=k, role=Role.DRAFT)
        u = jax.vmap(lambda key: jax.random.uniform(key, ()))(keys)
        return jnp.minimum((u * (cap + 1).astype(jnp.float32)).astype(jnp.int32), cap)
    if confidence is None:
        raise ValueError("verify_len 'scheduled' needs a drafter with confidence logits")
    temps, step_seconds, overhead, eps, dynamic = sched
    ell = schedule.padded_verify_len(confidence, temps, active, cap, step_seconds, overhead, eps)
    return jnp.where(dynamic, jnp.clip(ell.astype(jnp.int32), 0, cap), cap)


def speculative_step(params, drafter: Drafter, weights, state, dstate, anchor, sampling, step,
                     active, budget, *, k: int, verify_len: VerifyLen = VerifyLen(), sched=None,
                     stops=None, constraint=None, row_floor=None) -> StepOut:
    """One draft -> verify -> accept -> rollback -> drafter update step (module docstring).

    state: the target's contiguous `DecodeState` (lengths = each row's anchor position);
    dstate: the drafter's state; anchor int32 [B]; step int32 [B] the request-local step
    counter (draft / accept / final keys); active bool [B] the rows that step (the others
    keep everything); budget int32 [B] tokens each row may still emit. stops: int32 [S] stop
    tokens (-1 = none) or None (the caller truncates). constraint: None, or (masks uint32
    [B,W] m_0, session int32) of a registered `structured.ConstrainedBatch`. row_floor: the
    engine's prefix-cache floor, passed to the verify forward."""
    V = params.config.vocab_size
    B = anchor.shape[0]
    K = k + 1
    lengths = state.lengths
    cap = jnp.where(active, jnp.clip(budget - 1, 0, k), 0)
    constrain = None
    if constraint is not None:      # grammar masks at every draft slot, one host call per slot
        masks, session = constraint

        def host(x):
            return io_callback(structured.host_draft,
                               (jax.ShapeDtypeStruct(masks.shape, jnp.uint32),
                                jax.ShapeDtypeStruct((B,), jnp.bool_)),
                               session, x, active, ordered=False)
        constrain = (masks, host)
    d = drafter.draft(params, weights, dstate, anchor, lengths, sampling, step, active, k,
                      constrain)
    if constraint is not None:      # slots after a drafted EOS / dead end (decided from x_j, §2.5)
        cap = jnp.minimum(cap, jnp.where(jnp.any(d.stop, 1), jnp.argmax(d.stop, 1) + 1, k))
    ell = jnp.where(active, verify_lengths(d.confidence, active, cap, verify_len, sched,
                                           sampling.seed, step, k), 0)
    ids = jnp.concatenate([anchor[:, None], d.tokens], axis=1)
    n_new = jnp.where(active, ell + 1, 0)
    taps = drafter.taps(weights)

    def verify_forward(ids_s):
        logits, new_state, feats = target_features(transformer.forward_chunk(
            params, state, ids_s, n_new, all_logits=True, row_floor=row_floor, **taps))
        return (logits, feats), new_state

    widths = verify_len.widths
    if verify_len.mode == "fixed" and (widths is None or len(widths) == 1):
        (logits, feats), new_state = verify_forward(ids)
    else:   # the padded forward runs 1 + max(ell) columns: shorter ell saves compute
        (logits, feats), new_state = schedule.run_with_columns(
            verify_forward, ids, schedule.verify_columns(ell, active), widths)
    if constraint is not None:      # p~_j under the grammar state after the anchor and x_1..x_j
        logits = jnp.where(structured.unpack_bitmask(d.masks, V), logits, -jnp.inf)
    tokens, g = verify(logits, d.tokens, d.q, sampling, step, ell)
    n_emit = jnp.where(active, g + 1, 0)
    n_out, hit = n_emit, jnp.zeros((B,), bool)
    if stops is not None:
        is_stop = jnp.isin(tokens, stops) & (jnp.arange(K)[None] < n_emit[:, None])
        hit = jnp.any(is_stop, axis=1)
        n_out = jnp.where(hit, jnp.argmax(is_stop, axis=1) + 1, n_emit)
    next_masks = ended = None
    if constraint is not None:      # roll the matchers back to the accepted drafts
        next_masks, ended, n_keep = io_callback(
            structured.host_commit,
            (jax.ShapeDtypeStruct(masks.shape, jnp.uint32),
             jax.ShapeDtypeStruct((B,), jnp.bool_), jax.ShapeDtypeStruct((B,), jnp.int32)),
            session, tokens, g, n_out, active, ordered=False)
        ended = ended & active
        n_out = jnp.where(active, jnp.minimum(n_out, n_keep), 0)
        hit = hit | ended
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[..., None],
                                   -1)[..., 0]
    dstate = drafter.commit(params, weights, d.state, feats, tokens, n_emit, lengths, active)
    new_anchor = jnp.where(active, jnp.take_along_axis(tokens, g[:, None], 1)[:, 0], anchor)
    return StepOut(tokens, g, n_emit, n_out, hit, ell, logprobs, d.confidence,
                   rollback(new_state, lengths + n_emit), dstate, new_anchor, next_masks, ended)


# --- verify-length policy from the user's arguments ------------------------------------------


def check_confidence(drafter: Drafter) -> None:
    """ArgumentError unless the drafter has a confidence head (a dynamic verify length)."""
    if not drafter.confidence:
        raise ArgumentError(f"speculative={drafter.name!r} has no confidence head: "
                            f"verify_len='dynamic' and verify_cost need one (it verifies every "
                            f"draft: verify_len='fixed' without verify_cost)")


def profile_args(drafter: Drafter, weights, k: int, verify_cost, batch: int, *, dynamic: bool,
                 widths=None):
    """(sched, widths) of the "scheduled" mode from a `schedule.VerifyCost` profile read at
    `batch` rows: sched = (STS temperatures [k], step seconds [k+1] as the compiled widths cost
    them (`schedule.bucketed_seconds`), overhead, eps, dynamic flag); widths: the given ones,
    else those where the profile gets >= 10% cheaper (`schedule.column_buckets`)."""
    check_confidence(drafter)
    if verify_cost is None:
        raise ArgumentError("verify_len='dynamic' needs verify_cost= (a speculative.schedule."
                            "VerifyCost profile of the verify forward)")
    if not callable(getattr(verify_cost, "step_seconds_for", None)):
        raise ArgumentError(f"verify_cost must be a speculative.schedule.VerifyCost profile, "
                            f"got {type(verify_cost).__name__}")
    step_seconds = np.asarray(verify_cost.step_seconds_for(batch), np.float32)
    if step_seconds.shape != (k + 1,):
        raise ArgumentError(f"verify_cost.step_seconds_for({batch}) has shape "
                            f"{step_seconds.shape}; expected ({k + 1},) for a drafter with "
                            f"block size {k}")
    widths = tuple(widths) if widths else schedule.column_buckets(step_seconds)
    seconds = schedule.bucketed_seconds(step_seconds, widths).astype(np.float32)
    sched = (drafter.sts_temperatures(weights), jnp.asarray(seconds),
             jnp.float32(getattr(verify_cost, "overhead_seconds", 0.0)),
             jnp.float32(getattr(verify_cost, "eps", 0.0)), jnp.asarray(bool(dynamic)))
    return sched, widths


def verify_policy(drafter: Drafter, weights, k: int, verify_len: str, verify_cost,
                  batch: int) -> tuple[VerifyLen, tuple | None]:
    """(VerifyLen, sched) for generate's verify_len / verify_cost arguments: "fixed" without a
    profile -> every draft; "random" -> the diagnostic; "dynamic", or "fixed" given a profile
    (the dynamic program with its flag off, so comparing the two compiles once) ->
    "scheduled" (`profile_args` at `batch` rows)."""
    if verify_len not in ("fixed", "dynamic", "random"):
        raise ArgumentError(f"verify_len must be 'fixed', 'dynamic' or 'random', got "
                            f"{verify_len!r}")
    if verify_len == "random" or (verify_len == "fixed" and verify_cost is None):
        if verify_cost is not None:
            raise ArgumentError(f"verify_cost is only used with verify_len='dynamic' or "
                                f"'fixed', not {verify_len!r}")
        return VerifyLen(verify_len), None
    sched, widths = profile_args(drafter, weights, k, verify_cost, batch,
                                 dynamic=verify_len == "dynamic")
    return VerifyLen("scheduled", widths), sched
