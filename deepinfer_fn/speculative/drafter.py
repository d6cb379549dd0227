"""The drafter interface: what the one speculative step (`speculative.loop.step`) asks of a
drafter (docs/MODEL.md §D2).

A `Drafter` is a frozen record of pure, jit-friendly functions plus two flags. It is static
(hashable: a jit static argument); the drafter's weights travel next to it as an ordinary
pytree (`weights`: a `DSpark`, or None when the drafter lives in the target's params, as the
MTP block does). Its per-row state is any pytree whose leaves all have the batch as their
leading axis, so `generate` keeps it in its loop carry and the engine gathers / scatters it
per slot without knowing what it holds.

Positions: every function that needs them gets `lengths` int32 [B], the target's committed
length (the anchor's position P: the target state holds 0..P-1, the anchor y_P is committed
but not processed yet; in `prefill`, the target length before the chunk). A drafter derives
its own positions from it, so its state never has to track the target's lengths.

The functions (B rows, k drafts per step, V vocabulary):

  resolve(params, weights, num_draft_tokens) -> (weights, k)
      host-side validation of the user's arguments (clear ValueError / ArgumentError); k is
      the draft width (a checkpoint constant for block drafters).
  taps(weights) -> dict
      extra `transformer.forward_chunk` keyword arguments for the target forwards whose
      outputs the drafter reads ({} or dict(taps=layer ids, tap="pre"|"post")).
  init_state(params, weights, batch, max_len, *, window_slots, k, dtype) -> state
      an empty state of `batch` rows.
  prefill(params, weights, state, lengths, feats, ids, n_new, next_ids, n_next) -> state
      after the target's prefill chunk ids [B,S] (n_new [B] valid) at positions lengths..;
      feats: `Features` of that chunk. next_ids [B,S] / n_next [B]: the token after each of
      the chunk's first n_next positions when the caller knows it (generate: the prompt), or
      None (the engine: only the chunk itself is known).
  draft(params, weights, state, anchor, lengths, sampling, step, active, k, constrain)
      -> `Draft`: k drafts per row after the anchor [B]; step [B] the request-local step
      counter of the draft keys (`sampling.request_key(..., role=DRAFT, slot=j)`); inactive
      rows' drafts are ignored and their state must come back unchanged. constrain: None, or
      (masks uint32 [B,W], host) for grammar masks at every draft slot (draft j + 1 drawn
      under m_j, `host(x) -> (m_{j+1}, stop [B])` an io_callback).
  commit(params, weights, state, feats, tokens, n_emit, lengths, active) -> state
      after acceptance: the verify forward's `Features` of [anchor, drafts] (columns
      0..n_emit-1 are committed: the anchor and the accepted drafts), tokens [B,k+1] the
      emitted tokens (the next anchor is tokens[n_emit - 1]); rows with n_emit = 0 unchanged.

confidence: `draft` returns per-slot confidence logits (needed by verify_len="dynamic");
sts_temperatures(weights) -> f32 [k] then gives their calibration temperatures.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Features:
    """What a target forward over a chunk [B,S] exposes to a drafter: streams [B,S,n,D] the
    final residual streams; taps [B,S,m,D] the tapped layer features (None without taps)."""

    streams: jax.Array
    taps: jax.Array | None = None


class Draft(NamedTuple):
    """A drafter's proposal: tokens int32 [B,k]; q f32 [B,k,V] the processed logits each draft
    was drawn from (softmax = q); confidence f32 [B,k] or None; state the drafter state after
    drafting; constrained only: masks uint32 [B,k+1,W] (m_0..m_k) and stop bool [B,k]."""

    tokens: jax.Array
    q: jax.Array
    confidence: jax.Array | None
    state: Any
    masks: jax.Array | None = None
    stop: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Drafter:
    """A drafter's functions (module docstring). Frozen and hashable: pass it to jitted
    functions as a static argument."""

    name: str
    resolve: Callable
    taps: Callable
    init_state: Callable
    prefill: Callable
    draft: Callable
    commit: Callable
    confidence: bool = False
    sts_temperatures: Callable | None = None

    def __post_init__(self):
        if self.confidence and self.sts_temperatures is None:
            raise ValueError(f"drafter {self.name!r}: confidence=True needs sts_temperatures")


def target_features(out) -> tuple:
    """(logits, new state, `Features`) of a `transformer.forward_chunk` result (3 outputs, or
    4 with taps)."""
    return out[0], out[1], Features(out[2], out[3] if len(out) > 3 else None)
