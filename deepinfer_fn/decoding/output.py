"""The output of `generate` / `stream_generate`."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


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
        """Speculative statistics over all rows and steps (docs/MODEL.md §D4.1): steps;
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
