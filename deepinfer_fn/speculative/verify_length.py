"""Verify lengths for the PADDED verify layout [B, S] (`transformer.forward_chunk`; docs/MODEL.md (DSpark)
§3.3 adapted), and running the verify forward on only the columns chosen.

A shorter row saves compute only when the whole batch's column count S shrinks, so
`padded_verify_len` chooses S (1..g+1) by an early-stopping scan over columns with the measured
cost of S columns (`cost.VerifyCost.step_seconds_for`) and sets ell_r = min(S - 1, cap_r).
`verify_columns` / `run_with_columns` then run the forward on S = 1 + max ell columns (a
`lax.switch` over the compiled widths, `column_buckets`) so that the saving counted on happens.

Losslessness (§2.5): admitting slot j of a row may only use information available before x_j
was drawn. a_{r,j} qualifies (c_{r,j} reads x_{j-1}); a_{r,j+1} does not. The scan walks the
columns in order, decides each from the columns already seen and stops at the first
non-improvement, so the admission of slot j never depends on a_{.,j+1} or later. (A global
argmax over lengths does look ahead and is biased: tests/test_schedule.py keeps that negative
control.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_fn.speculative.survival import survivals


def padded_verify_len(conf_logits, temps, active, cap, step_seconds, overhead_seconds,
                      eps=0.0):
    """Per-row verify lengths for a padded [B, S] verify forward (docs/MODEL.md §D3.3 adapted).

    conf_logits f32 [B,g] (confidence logits of the g drafted slots); temps f32 [g] (STS
    temperatures, ones when uncalibrated); active bool [B]; cap int32 [B] (most drafts row r
    may verify: tokens still allowed, <= g); step_seconds f32 [g+1] (verify forward time with
    S = 1..g+1 columns at this batch, `VerifyCost.step_seconds_for`); overhead_seconds the
    rest of the step (draft, sampling, bookkeeping); eps >= 0 the minimum relative gain.

    With a_{r,j} masked to active rows and j <= cap_r, and R the number of active rows,
    theta(S) = (R + sum_r sum_{j<S} a_{r,j}) / (overhead + step_seconds[S-1]) is the expected
    throughput with S columns. The scan starts at S = 1 and moves to S + 1 while
    theta(S+1) > theta(S) * (1 + eps); the admission of column S + 1 (slot S) reads only
    a_{., <=S}, never a_{., S+1}, which keeps it lossless (§2.5). Returns ell int32 [B]:
    min(S - 1, cap_r) for active rows, 0 for inactive ones.
    """
    z = jnp.asarray(conf_logits, jnp.float32)
    B, g = z.shape
    step_seconds = jnp.asarray(step_seconds, jnp.float32)
    if step_seconds.shape != (g + 1,):
        raise ValueError(f"step_seconds has shape {step_seconds.shape}, expected ({g + 1},) "
                         f"for g={g} drafts (columns 1..g+1)")
    active = jnp.asarray(active, bool)
    cap = jnp.clip(jnp.asarray(cap, jnp.int32), 0, g)
    a = survivals(z, temps)
    slot = jnp.arange(1, g + 1)
    a = jnp.where(active[:, None] & (slot[None] <= cap[:, None]), a, 0.0)
    R = jnp.sum(active).astype(jnp.float32)
    tau = R + jnp.concatenate([jnp.zeros((1,)), jnp.cumsum(jnp.sum(a, axis=0))])  # [g+1]: S=1..
    theta = tau / (jnp.float32(overhead_seconds) + step_seconds)
    improves = theta[1:] > theta[:-1] * (1.0 + jnp.float32(eps))                    # [g]
    S = 1 + jnp.sum(jnp.cumprod(improves.astype(jnp.int32)))                        # early stop
    return jnp.where(active, jnp.minimum(S - 1, cap), 0).astype(jnp.int32)


def verify_columns(ell, active):
    """S int32: the column count a padded verify forward needs for lengths ell [B] (the
    anchor + the longest active row's drafts), at least 1."""
    return 1 + jnp.max(jnp.where(jnp.asarray(active, bool), jnp.asarray(ell, jnp.int32), 0))


def column_buckets(step_seconds, rel_tol: float = 0.1) -> tuple[int, ...]:
    """The column counts worth compiling for a padded verify forward, from its cost row
    step_seconds [K] (columns 1..K at this batch): walking down from K, a count S is kept when
    it costs less than (1 - rel_tol) x the last kept count (the largest count of each cheaper
    plateau); K is always kept. A flat profile gives (K,): shrinking saves nothing there, so
    nothing else is compiled (each kept count is one branch of `run_with_columns`)."""
    sec = np.maximum.accumulate(np.asarray(step_seconds, np.float64))
    kept = [len(sec)]
    for s in range(len(sec) - 1, 0, -1):
        if sec[s - 1] < (1.0 - rel_tol) * sec[kept[-1] - 1]:
            kept.append(s)
    return tuple(sorted(kept))


def bucketed_seconds(step_seconds, buckets) -> np.ndarray:
    """step_seconds [K] as a forward restricted to `buckets` costs: S columns cost what the
    smallest bucket >= S costs (what the scheduler should see when only those widths run)."""
    sec = np.asarray(step_seconds, np.float64)
    idx = np.searchsorted(np.asarray(buckets), np.arange(1, len(sec) + 1), side="left")
    return sec[np.asarray(buckets)[idx] - 1]


def run_with_columns(fn, ids, n_columns, buckets=None):
    """Runs `fn` on the first S columns of ids [B, K] only (S = the smallest of `buckets` that is
    >= n_columns; default buckets 1..K, i.e. S = n_columns), so a padded verify forward costs S
    columns, not K (the saving `padded_verify_len` assumes).

    n_columns: traced int32 in 1..K (clipped), e.g. `verify_columns(ell, active)`; buckets:
    static ascending column counts ending at K (`column_buckets`). fn(ids_S [B, S]) ->
    (per_token, rest): per_token a pytree of arrays [B, S, ...] (logits, streams, taps), padded
    back to K columns with zeros; rest a pytree whose shapes do not depend on S (the new decode
    state). Implemented as `lax.switch` over the bucket widths: every bucket is compiled once
    (one branch each), one runs per step."""
    B, K = ids.shape
    buckets = tuple(range(1, K + 1)) if buckets is None else tuple(int(b) for b in buckets)
    if not buckets or buckets[-1] != K or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
        raise ValueError(f"buckets {buckets} must be ascending column counts ending at K={K}")

    def branch(s):
        def run(ids):
            per_token, rest = fn(ids[:, :s])
            pad = lambda x: jnp.pad(x, [(0, 0), (0, K - s)] + [(0, 0)] * (x.ndim - 2))
            return jax.tree.map(pad, per_token), rest
        return run

    n = jnp.clip(jnp.asarray(n_columns, jnp.int32), 1, K)
    index = jnp.searchsorted(jnp.asarray(buckets, jnp.int32), n, side="left")
    if len(buckets) == 1:
        return branch(K)(ids)
    return jax.lax.switch(index, [branch(s) for s in buckets], ids)

