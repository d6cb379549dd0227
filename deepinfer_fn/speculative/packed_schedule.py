"""Verify-length policies for a PACKED (ragged) verify layout (docs/MODEL.md §D3.3, §3.4): the
exact early-stopping scheduler `schedule_sync` (host), `choose_capacity` (host, stale survivals,
full search over capacity buckets) and `allocate_topk` (jittable, the top-(C - R) candidates of
this step's fresh survivals with the tie rule). generate and the engine use the padded layout
(`verify_length`); these are the policy a packed verify layout would use.

Each walks candidates (r, j) in an order in which (r, j) precedes (r, j + 1) and stops at the
first non-improvement, so admitting (r, j) never reads a_{r,j+1} (lossless, §2.5); a capacity
chosen from stale survivals (earlier steps) may use a full search (§3.4).
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np

from deepinfer_fn.speculative.cost import cost_function


def candidate_order(a, valid) -> np.ndarray:
    """Flat indices (r * g + j) of the valid candidates in scheduling order: a descending,
    ties by slot j ascending, then by request r ascending (§3.3). Because a is non-increasing
    along j, (r, j) always precedes (r, j + 1): every prefix of the order is prefix-closed per
    request."""
    a = np.asarray(a, np.float64)
    R, g = a.shape
    r, j = np.meshgrid(np.arange(R), np.arange(g), indexing="ij")
    flat = np.flatnonzero(np.asarray(valid).ravel())
    order = np.lexsort((r.ravel()[flat], j.ravel()[flat], -a.ravel()[flat]))
    return flat[order]


def schedule_sync(a, cap, verify_seconds, fixed_seconds: float, eps: float = 0.0,
                  active=None) -> np.ndarray:
    """Exact synchronous early-stopping scheduler for a packed verify layout (§3.3; host).

    a [R,g] prefix survivals of this step (non-increasing along g); cap [R] (<= g); verify
    seconds of a forward with B tokens (`cost.cost_function`); fixed_seconds = T_fixed + T_draft(R);
    eps >= 0 hysteresis. Starting from B = R (anchors only), walk the candidates in
    `candidate_order` and admit each while it raises the expected throughput
    tau / (fixed + T_verify(B)) by more than the factor (1 + eps); stop at the first that does
    not (never look further: lossless, §2.5). Returns ell int [R]."""
    a = np.asarray(a, np.float64)
    R, g = a.shape
    active = np.ones(R, bool) if active is None else np.asarray(active, bool)
    cap = np.clip(np.asarray(cap), 0, g)
    cost = cost_function(verify_seconds)
    valid = active[:, None] & (np.arange(1, g + 1)[None] <= cap[:, None]) & (a > 0)
    n_req = int(active.sum())
    B, tau = n_req, float(n_req)
    best = tau / (fixed_seconds + cost(B)) if n_req else 0.0
    ell = np.zeros(R, np.int64)
    for idx in candidate_order(a, valid):
        r, j = divmod(int(idx), g)
        new_tau = tau + a[r, j]
        new_theta = new_tau / (fixed_seconds + cost(B + 1))
        if new_theta <= best * (1 + eps):
            break
        ell[r] = j + 1
        B, tau, best = B + 1, new_tau, new_theta
    return ell


def default_buckets(n_requests: int, gamma: int, multiple: int = 32) -> list[int]:
    """Capacity buckets for R requests (§2.6): R, the multiples of `multiple` in between, and
    R * (gamma + 1)."""
    top = n_requests * (gamma + 1)
    mids = range((n_requests // multiple + 1) * multiple, top, multiple)
    return sorted({n_requests, *mids, top})


def choose_capacity(stale_a, cap, buckets: Sequence[int], verify_seconds,
                    fixed_seconds: float, active=None) -> tuple[int, np.ndarray]:
    """Host-side capacity choice from STALE survivals (§3.4).

    stale_a [R,g]: each request's prefix survivals from its latest finished step (rows without
    history: NaN, replaced by the per-slot mean of the others, or 1 when nobody has history);
    cap [R]; buckets: candidate token capacities; verify seconds as in `schedule_sync`.
    For each bucket C >= R: est_tau = R + the (C - R) largest valid stale survivals,
    theta = est_tau / (fixed + T_verify(C)); returns (argmax C, theta per bucket [nb], -inf for
    buckets below R). A full search is lossless here because nothing of the current step's
    drafts enters it; it can jump over cliffs of a jagged cost curve."""
    a = np.array(stale_a, np.float64)
    R, g = a.shape
    active = np.ones(R, bool) if active is None else np.asarray(active, bool)
    missing = np.isnan(a).any(axis=1)
    if missing.any():
        known = a[~missing & active]
        fill = known.mean(axis=0) if len(known) else np.ones(g)
        a[missing] = fill
    cap = np.clip(np.asarray(cap), 0, g)
    valid = active[:, None] & (np.arange(1, g + 1)[None] <= cap[:, None]) & (a > 0)
    vals = np.sort(a[valid])[::-1]
    gains = np.concatenate([[0.0], np.cumsum(vals)])
    cost = cost_function(verify_seconds)
    n_req = int(active.sum())
    buckets = [int(b) for b in buckets]
    theta = np.full(len(buckets), -np.inf)
    for i, C in enumerate(buckets):
        if C >= n_req:
            k = min(C - n_req, len(vals))
            theta[i] = (n_req + gains[k]) / (fixed_seconds + cost(C))
    if not np.isfinite(theta).any():
        raise ValueError(f"no capacity bucket holds the {n_req} anchors: {buckets}")
    return buckets[int(np.argmax(theta))], theta


def allocate_topk(a, active, cap, n_slots):
    """Device-side allocation inside a step of capacity C (§3.4; jittable).

    a f32 [R,g] fresh prefix survivals; active bool [R]; cap int32 [R]; n_slots = C - R
    (int or traced int32): the verify slots of the bucket. Takes the n_slots best candidates
    (a > 0, j <= cap_r, active rows) in `candidate_order`'s order (a descending, ties by slot
    then request); the taken set is a prefix of every request. Returns ell int32 [R]."""
    a = jnp.asarray(a, jnp.float32)
    R, g = a.shape
    slot = jnp.arange(1, g + 1)
    valid = (jnp.asarray(active, bool)[:, None] & (slot[None] <= jnp.asarray(cap)[:, None])
             & (a > 0))
    r_idx = jnp.broadcast_to(jnp.arange(R)[:, None], (R, g)).ravel()
    j_idx = jnp.broadcast_to(jnp.arange(g)[None], (R, g)).ravel()
    key = jnp.where(valid.ravel(), -a.ravel(), jnp.inf)          # invalid last
    order = jnp.lexsort((r_idx, j_idx, key))
    rank = jnp.zeros((R * g,), jnp.int32).at[order].set(jnp.arange(R * g, dtype=jnp.int32))
    taken = valid.ravel() & (rank < jnp.asarray(n_slots, jnp.int32))
    return jnp.sum(taken.reshape(R, g), axis=1).astype(jnp.int32)

