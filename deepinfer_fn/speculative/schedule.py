"""Verify-length scheduling for speculative decoding (spec/dspark.md §3, §1.5, §2.5).

Each step the drafter proposes g tokens per row with confidence logits z [B,g]; the scheduler
decides how many of them (ell_r, 0 <= ell_r <= g) the target verifies, trading expected
accepted tokens against the verify forward's cost.

Survivals (§1.5): c_{r,j} = sigmoid(z_{r,j} / t_j) (t: STS temperatures), a_{r,j} =
prod_{i<=j} c_{r,i} = P(first j drafts of row r all accepted). Expected committed tokens of
the step: tau = sum_r (1 + sum_{j<=ell_r} a_{r,j}).

Losslessness (§2.5): admitting slot j of a row may only use information available before x_j
was drawn. a_{r,j} qualifies (c_{r,j} reads x_{j-1}); a_{r,j+1} does not. Every scheduler here
is an *early-stopping* scan: it walks candidates in an order in which (r, j) precedes (r, j+1),
decides each admission from candidates already seen, and stops at the first non-improvement,
so the admission of (r, j) never depends on a_{r,j+1} or later. (A global argmax over lengths
does look ahead and is biased: tests/test_schedule.py keeps that negative control.) A capacity
chosen from *stale* survivals (earlier steps) may use a full search (§3.4).

Contents:

* `padded_verify_len` (jittable): the scheduler for our PADDED verify layout [B, S]
  (`transformer.forward_chunk`): a shorter row saves compute only when the whole batch's
  column count S shrinks, so it chooses S (1..g+1) by the early-stopping scan over columns
  with the measured cost of S columns, and ell_r = min(S - 1, cap_r).
* `verify_columns` / `run_with_columns`: run the verify forward on S = 1 + max ell columns
  (`lax.switch` over the static widths) so that the saving the scheduler counts on happens.
* `VerifyCost`: the measured verify step time vs (batch rows, columns) (or vs tokens),
  isotonic in the columns, interpolated between measured batches, saved/loaded as JSON;
  `measure_verify_cost` times the target's verify forward on the current device.
* The PACKED-layout (ragged, production) schedulers of §3.3/§3.4: `schedule_sync` (exact
  early-stopping scheduler, host numpy), `choose_capacity` (host, stale survivals, full search
  over capacity buckets) and `allocate_topk` (jittable, top-(C - R) candidates of this step's
  fresh survivals with the tie rule). Our generate uses the padded layout; these are the
  policy a packed verify layout would use.
* STS calibration (§1.5): `sts_calibrate` and `calibration_report`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


# --- survivals ------------------------------------------------------------------------------


def survivals(conf_logits, temps):
    """a [B,g] f32: a_{r,j} = prod_{i<=j} sigmoid(z_{r,i} / t_i) (§1.5). conf_logits [B,g],
    temps [g] (> 0)."""
    z = jnp.asarray(conf_logits, jnp.float32)
    t = jnp.asarray(temps, jnp.float32)
    return jnp.cumprod(jax.nn.sigmoid(z / t), axis=-1)


def survivals_np(conf_logits, temps) -> np.ndarray:
    """`survivals` in float64 numpy (host-side schedulers and calibration)."""
    z = np.asarray(conf_logits, np.float64)
    t = np.asarray(temps, np.float64)
    return np.cumprod(_sigmoid(z / t), axis=-1)


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


# --- padded layout ---------------------------------------------------------------------------


def padded_verify_len(conf_logits, temps, active, cap, step_seconds, overhead_seconds,
                      eps=0.0):
    """Per-row verify lengths for a padded [B, S] verify forward (spec/dspark.md §3.3 adapted).

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


# --- isotonic fit -----------------------------------------------------------------------------


def isotonic_increasing(y, w=None) -> np.ndarray:
    """The non-decreasing sequence closest to y in weighted least squares (pool adjacent
    violators). y [n], w [n] > 0 (default ones)."""
    y = np.asarray(y, np.float64)
    w = np.ones_like(y) if w is None else np.asarray(w, np.float64)
    vals, wts, lens = [], [], []
    for yi, wi in zip(y, w):
        vals.append(yi), wts.append(wi), lens.append(1)
        while len(vals) > 1 and vals[-2] > vals[-1]:
            v1, w1, n1 = vals.pop(), wts.pop(), lens.pop()
            v0, w0, n0 = vals.pop(), wts.pop(), lens.pop()
            vals.append((v0 * w0 + v1 * w1) / (w0 + w1)), wts.append(w0 + w1), lens.append(n0 + n1)
    return np.repeat(vals, lens)


# --- verify cost profile ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class VerifyCost:
    """Measured verify forward time (spec/dspark.md §3.1).

    Two kinds:
    * "grid": `seconds[i, s]` = time of a verify forward over `batches[i]` rows and s + 1
      columns (s = 0..gamma), isotonic (non-decreasing) in the columns for each batch and
      made non-decreasing across batches (cumulative max);
    * "tokens": `seconds[0, i]` = time of a forward of `tokens[i]` tokens in the batch
      (isotonic in tokens); a padded [B, S] forward costs the value at B * S.

    `step_seconds_for(batch)` -> [gamma + 1] seconds for S = 1..gamma+1 columns: for a grid,
    linear interpolation between the neighbouring measured batches (outside the measured range:
    the token curve built from the grid's own points, linearly extrapolated). `overhead_seconds`
    is the rest of a speculative step (draft, sampling) when known, else 0. `raw` keeps the
    medians before fitting; `meta` free-form (device, context, repeats ...); `eps` the
    scheduler's minimum relative gain (padded_verify_len's eps).
    """

    kind: str
    gamma: int
    points: tuple[int, ...]          # grid: batches; tokens: token counts (ascending)
    seconds: np.ndarray              # grid: [len(points), gamma+1]; tokens: [len(points)]
    raw: np.ndarray | None = None
    overhead_seconds: float = 0.0
    meta: dict = dataclasses.field(default_factory=dict)
    eps: float = 1e-6                # scheduler hysteresis (minimum relative gain)

    def __post_init__(self):
        if self.kind not in ("grid", "tokens"):
            raise ValueError(f"VerifyCost kind must be 'grid' or 'tokens', got {self.kind!r}")
        pts = np.asarray(self.points)
        if pts.ndim != 1 or len(pts) == 0 or np.any(np.diff(pts) <= 0) or pts[0] < 1:
            raise ValueError(f"VerifyCost points must be ascending positive ints, got {self.points}")
        want = (len(pts), self.gamma + 1) if self.kind == "grid" else (len(pts),)
        if np.shape(self.seconds) != want:
            raise ValueError(f"VerifyCost seconds has shape {np.shape(self.seconds)}, want {want}")
        if not np.all(np.isfinite(self.seconds)) or np.any(np.asarray(self.seconds) <= 0):
            raise ValueError("VerifyCost seconds must be finite and positive")

    # construction ------------------------------------------------------------------------
    @classmethod
    def from_grid(cls, batches: Sequence[int], seconds, *, overhead_seconds=0.0, meta=None):
        """batches [nb] ascending; seconds [nb, gamma+1] measured (medians) for columns
        1..gamma+1. Fits monotone: isotonic along columns, then cumulative max over batches."""
        raw = np.asarray(seconds, np.float64)
        if raw.ndim != 2 or raw.shape[0] != len(batches) or raw.shape[1] < 2:
            raise ValueError(f"seconds must be [len(batches), gamma+1], got {raw.shape}")
        order = np.argsort(batches)
        batches = tuple(int(b) for b in np.asarray(batches)[order])
        raw = raw[order]
        fit = np.stack([isotonic_increasing(row) for row in raw])
        fit = np.maximum.accumulate(fit, axis=0)
        return cls("grid", raw.shape[1] - 1, batches, fit, raw, float(overhead_seconds),
                   dict(meta or {}))

    @classmethod
    def from_tokens(cls, tokens: Sequence[int], seconds, gamma: int, *, overhead_seconds=0.0,
                    meta=None):
        """A profile vs tokens in the forward (1-D, isotonic)."""
        tokens = np.asarray(tokens)
        raw = np.asarray(seconds, np.float64)
        if raw.shape != tokens.shape or tokens.ndim != 1:
            raise ValueError(f"tokens {tokens.shape} and seconds {raw.shape} must be equal 1-D")
        order = np.argsort(tokens)
        tokens, raw = tokens[order], raw[order]
        return cls("tokens", int(gamma), tuple(int(t) for t in tokens), isotonic_increasing(raw),
                   raw, float(overhead_seconds), dict(meta or {}))

    # queries ------------------------------------------------------------------------------
    def token_curve(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [n] ascending, seconds [n] non-decreasing): the 1-D view of the profile."""
        if self.kind == "tokens":
            return np.asarray(self.points, np.float64), np.asarray(self.seconds)
        cols = np.arange(1, self.gamma + 2)
        tok = (np.asarray(self.points)[:, None] * cols[None]).ravel().astype(np.float64)
        sec = np.asarray(self.seconds).ravel()
        order = np.argsort(tok, kind="stable")
        tok, sec = tok[order], sec[order]
        uniq, inv = np.unique(tok, return_inverse=True)
        mean = np.bincount(inv, sec) / np.bincount(inv)
        return uniq, isotonic_increasing(mean, np.bincount(inv).astype(np.float64))

    def seconds_at_tokens(self, tokens) -> np.ndarray:
        """Forward time at `tokens` tokens (the token curve; linear extrapolation beyond the
        largest measured count from the last segment's slope, clamped below)."""
        tok, sec = self.token_curve()
        x = np.asarray(tokens, np.float64)
        y = np.interp(x, tok, sec)
        if len(tok) >= 2:
            slope = max((sec[-1] - sec[-2]) / (tok[-1] - tok[-2]), 0.0)
            y = np.where(x > tok[-1], sec[-1] + slope * (x - tok[-1]), y)
        return y

    def knee_tokens(self) -> float | None:
        """Token count where the cost curve's slope first reaches half of its large-B slope
        (the last segment of the token curve) -- spec §4.3 step 2; None when the curve never
        rises (flat: the knee lies beyond the measured range)."""
        tok, sec = self.token_curve()
        if len(tok) < 2:
            return None
        slopes = np.diff(sec) / np.diff(tok)
        if slopes[-1] <= 0:
            return None
        return float(tok[int(np.argmax(slopes >= 0.5 * slopes[-1]))])

    def step_seconds_for(self, batch: int) -> np.ndarray:
        """float32 [gamma+1]: verify time with S = 1..gamma+1 columns at `batch` rows
        (non-decreasing in S)."""
        batch = int(batch)
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        cols = np.arange(1, self.gamma + 2)
        pts = np.asarray(self.points)
        if self.kind == "tokens" or batch < pts[0] or batch > pts[-1]:
            out = self.seconds_at_tokens(batch * cols)
        else:
            i = int(np.searchsorted(pts, batch, side="left"))
            if pts[i] == batch:
                out = np.asarray(self.seconds[i])
            else:
                lo, hi = pts[i - 1], pts[i]
                f = (batch - lo) / (hi - lo)
                out = (1 - f) * self.seconds[i - 1] + f * self.seconds[i]
        return np.maximum.accumulate(np.asarray(out, np.float64)).astype(np.float32)

    # persistence -------------------------------------------------------------------------
    def to_json(self) -> dict:
        return dict(kind=self.kind, gamma=self.gamma, points=list(self.points),
                    seconds=np.asarray(self.seconds).tolist(),
                    raw=None if self.raw is None else np.asarray(self.raw).tolist(),
                    overhead_seconds=self.overhead_seconds, meta=self.meta, eps=self.eps)

    @classmethod
    def from_json(cls, d: dict) -> "VerifyCost":
        missing = {"kind", "gamma", "points", "seconds"} - set(d)
        if missing:
            raise ValueError(f"verify cost profile lacks {sorted(missing)}")
        return cls(d["kind"], int(d["gamma"]), tuple(int(p) for p in d["points"]),
                   np.asarray(d["seconds"], np.float64),
                   None if d.get("raw") is None else np.asarray(d["raw"], np.float64),
                   float(d.get("overhead_seconds", 0.0)), dict(d.get("meta", {})),
                   float(d.get("eps", 1e-6)))

    def save(self, path) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    @classmethod
    def load(cls, path) -> "VerifyCost":
        with open(path) as f:
            return cls.from_json(json.load(f))

    def with_overhead(self, overhead_seconds: float) -> "VerifyCost":
        return dataclasses.replace(self, overhead_seconds=float(overhead_seconds))

    def with_eps(self, eps: float) -> "VerifyCost":
        if eps < 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        return dataclasses.replace(self, eps=float(eps))


def flat_cost(gamma: int, seconds: float = 1.0, batches=(1,)) -> VerifyCost:
    """A cost that does not depend on the columns (verify-everything regime); for tests."""
    return VerifyCost.from_grid(batches, np.full((len(batches), gamma + 1), seconds))


# --- measuring the cost on the device --------------------------------------------------------


def measure_verify_cost(params, batches: Sequence[int], gamma: int, *, context: int = 256,
                        repeats: int = 10, warmup: int = 2, seed: int = 0,
                        window_slots: int | None = None, in_loop: int = 0,
                        verbose: bool = False) -> VerifyCost:
    """Times the target's verify forward on the default device (`measure_verify_times` for
    columns 1..gamma+1) and returns `VerifyCost.from_grid` (isotonic fit; raw medians kept).
    in_loop > 0 times it inside a device loop (generate's decode loop); 0 as one device call
    per forward (the engine's steps)."""
    if gamma < 1 or not batches:
        raise ValueError(f"need gamma >= 1 and at least one batch, got {gamma}, {batches}")
    table = measure_verify_times(params, batches, range(1, gamma + 2), context=context,
                                 repeats=repeats, warmup=warmup, seed=seed,
                                 window_slots=window_slots or 0, slack=gamma, in_loop=in_loop,
                                 verbose=verbose)
    return VerifyCost.from_grid([int(b) for b in batches], table,
                                meta=_measure_meta(params, context, repeats, in_loop))


def _measure_meta(params, context, repeats, in_loop=0) -> dict:
    return dict(device=str(jax.devices()[0].device_kind), platform=jax.default_backend(),
                context=context, repeats=repeats, dtype=str(jnp.dtype(params.dtype)),
                in_loop=int(in_loop))


def measure_verify_times(params, batches: Sequence[int], columns: Sequence[int], *,
                         context: int = 256, repeats: int = 10, warmup: int = 2, seed: int = 0,
                         window_slots: int = 0, slack: int | None = None, in_loop: int = 0,
                         compile_threads: int | None = None,
                         verbose: bool = False) -> np.ndarray:
    """seconds float64 [len(batches), len(columns)]: median time of the target's verify forward.

    For each batch B: a decode state prefilled with `context` random tokens per row (real
    prefill, so every ring/row is valid), then for each S in `columns` the jitted
    `transformer.forward_chunk(params, state, ids [B,S], n_new=S, all_logits=True)` with the
    state donated and its lengths moved back after each forward (what a rejected verify does).

    in_loop = 0: one jitted call per forward, timed from the host (block_until_ready): what a
    step that is its own device call pays, dispatch and sync included.
    in_loop = n > 0: one jitted call runs n forwards in a `lax.fori_loop` (each followed by the
    rollback, each one's logits reduced by an argmax so none is elided) and reports the call's
    time / n: the cost inside a device-side decode loop (generate's), where no forward pays a
    host round trip. For a small model the two differ by the launch/sync floor.

    All (B, S) programs are compiled first, `compile_threads` at a time (default: all at once;
    XLA compiles release the GIL, and GPU compiles are slow); then each is timed: `warmup` runs,
    then the median of `repeats`. `slack` (default max(columns) - 1): extra window slots, as a
    speculative loop has."""
    from concurrent.futures import ThreadPoolExecutor

    from deepinfer_fn.generate import prefill
    from deepinfer_fn.speculative.verify import rollback
    from deepinfer_fn.state import init_state

    cfg = params.config
    columns = [int(c) for c in columns]
    batches = [int(b) for b in batches]
    if not batches or not columns or min(columns) < 1 or min(batches) < 1:
        raise ValueError(f"need batches and columns >= 1, got {batches}, {columns}")
    if in_loop < 0 or repeats < 1 or warmup < 0:
        raise ValueError(f"need in_loop >= 0, repeats >= 1, warmup >= 0, got {in_loop}, "
                         f"{repeats}, {warmup}")
    slack = max(columns) - 1 if slack is None else slack
    if context < 1 or context + max(columns) > cfg.max_position_embeddings:
        raise ValueError(f"context={context} out of range for max_position_embeddings="
                         f"{cfg.max_position_embeddings}")
    slots = max(window_slots, cfg.sliding_window + slack)
    fwd = jax.jit(verify_forward_program(max(in_loop, 1), looped=in_loop > 0),
                  donate_argnums=(1,))
    rng = np.random.default_rng(seed)
    states, calls = {}, []
    for B in batches:
        state = init_state(cfg, B, context + max(columns) + 16, window_slots=slots,
                           dtype=params.dtype)
        prompt = rng.integers(2, cfg.vocab_size, size=(B, context)).astype(np.int32)
        _, states[B] = prefill(params, state, prompt, np.full((B,), context, np.int32),
                               min(context, 512))
        for S in columns:
            ids = jnp.asarray(rng.integers(2, cfg.vocab_size, size=(B, S)), jnp.int32)
            calls.append((B, S, ids, jnp.full((B,), S, jnp.int32)))

    def compile_one(call):
        B, S, ids, n_new = call
        return fwd.lower(params, states[B], ids, n_new, states[B].lengths).compile()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=compile_threads or len(calls)) as pool:
        programs = list(pool.map(compile_one, calls))
    if verbose:
        print(f"  verify cost: {len(calls)} programs compiled in {time.perf_counter() - t0:.1f} s",
              flush=True)
    per_call = max(in_loop, 1)
    seconds = {}
    for (B, S, ids, n_new), program in zip(calls, programs):
        state = states[B]
        lengths0 = np.asarray(state.lengths)   # a host copy: the state is donated
        times = []
        for it in range(warmup + repeats):
            rewind = jnp.asarray(lengths0)
            t = time.perf_counter()
            check, state = program(params, state, ids, n_new, rewind)
            check.block_until_ready()
            if it >= warmup:
                times.append((time.perf_counter() - t) / per_call)
            state = rollback(state, jnp.asarray(lengths0))
        states[B] = state
        seconds[B, S] = float(np.median(times))
        if verbose:
            print(f"  verify cost: batch {B:4d} columns {S}: {seconds[B, S] * 1e3:8.3f} ms"
                  f"{f' (in a loop of {in_loop})' if in_loop else ''}", flush=True)
    return np.asarray([[seconds[B, S] for S in columns] for B in batches], np.float64)


def verify_forward_program(n: int, *, looped: bool):
    """fn(params, state, ids [B,S], n_new [B], lengths0 [B]) -> (check, state): n verify forwards
    from the same state (rolled back to lengths0 after each) in a fori_loop (looped), or one
    forward (not looped). `check` int32: the sum of every forward's argmax tokens, so each
    forward's logits are needed, and equal n x the single forward's sum."""
    from deepinfer_fn.model import transformer
    from deepinfer_fn.speculative.verify import rollback

    def one(params, state, ids, n_new):
        logits, state = transformer.forward_chunk(params, state, ids, n_new, all_logits=True)[:2]
        return jnp.sum(jnp.argmax(logits, axis=-1), dtype=jnp.int32), state

    def run(params, state, ids, n_new, lengths0):
        if not looped:
            return one(params, state, ids, n_new)

        def body(_, carry):
            total, st = carry
            check, st = one(params, st, ids, n_new)
            return total + check, rollback(st, lengths0)

        return jax.lax.fori_loop(0, n, body, (jnp.int32(0), state))

    return run


# --- packed (ragged) layout: the production policy of §3.3 / §3.4 -----------------------------


def _as_cost_fn(verify_seconds):
    """verify_seconds: a callable tokens -> seconds, a `VerifyCost` (its token curve), or an
    array indexed by the token count."""
    if isinstance(verify_seconds, VerifyCost):
        return lambda n: float(verify_seconds.seconds_at_tokens(n))
    if callable(verify_seconds):
        return lambda n: float(verify_seconds(n))
    table = np.asarray(verify_seconds, np.float64)
    return lambda n: float(table[int(n)])


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
    seconds of a forward with B tokens (`_as_cost_fn`); fixed_seconds = T_fixed + T_draft(R);
    eps >= 0 hysteresis. Starting from B = R (anchors only), walk the candidates in
    `candidate_order` and admit each while it raises the expected throughput
    tau / (fixed + T_verify(B)) by more than the factor (1 + eps); stop at the first that does
    not (never look further: lossless, §2.5). Returns ell int [R]."""
    a = np.asarray(a, np.float64)
    R, g = a.shape
    active = np.ones(R, bool) if active is None else np.asarray(active, bool)
    cap = np.clip(np.asarray(cap), 0, g)
    cost = _as_cost_fn(verify_seconds)
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
    cost = _as_cost_fn(verify_seconds)
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


# --- STS calibration (§1.5) --------------------------------------------------------------------


def default_temperature_grid(n: int = 60, lo: float = 0.25, hi: float = 8.0) -> np.ndarray:
    """n log-spaced temperatures in [lo, hi], plus 1.0 (the uncalibrated head)."""
    return np.unique(np.append(np.geomspace(lo, hi, n), 1.0))


def ece(prob, outcome, n_bins: int = 15) -> float:
    """Expected calibration error: count-weighted mean |mean prob - mean outcome| over
    n_bins equal-width probability bins."""
    prob = np.asarray(prob, np.float64).ravel()
    y = np.asarray(outcome, np.float64).ravel()
    if prob.size == 0:
        return float("nan")
    b = np.minimum((prob * n_bins).astype(np.int64), n_bins - 1)
    sp = np.bincount(b, prob, minlength=n_bins)
    sy = np.bincount(b, y, minlength=n_bins)
    return float(np.sum(np.abs(sp - sy)) / prob.size)


def auc(score, outcome) -> float:
    """Area under the ROC curve (Mann-Whitney, ties count half); nan with one class only."""
    s = np.asarray(score, np.float64).ravel()
    y = np.asarray(outcome, bool).ravel()
    n1, n0 = int(y.sum()), int((~y).sum())
    if n1 == 0 or n0 == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s))
    sorted_s = s[order]
    # average ranks over ties
    starts = np.flatnonzero(np.r_[True, np.diff(sorted_s) != 0])
    ends = np.r_[starts[1:], len(s)]
    avg = (starts + ends - 1) / 2.0 + 1.0
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[y].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def brier(prob, outcome) -> float:
    prob = np.asarray(prob, np.float64).ravel()
    return float(np.mean((prob - np.asarray(outcome, np.float64).ravel()) ** 2))


def prefix_outcomes(accepted, g: int) -> np.ndarray:
    """A [N,g] bool: A_k = 1[first k drafts all accepted] from accepted counts [N] of steps
    verified at full length g."""
    acc = np.asarray(accepted)
    if acc.ndim != 1 or np.any(acc < 0) or np.any(acc > g):
        raise ValueError(f"accepted must be [N] counts in 0..{g} (full-length verification)")
    return acc[:, None] >= np.arange(1, g + 1)[None]


def sts_calibrate(conf_logits, accepted, grid=None, n_bins: int = 15):
    """Sequential temperature scaling (§1.5).

    conf_logits [N,g] the head's confidence logits of N logged steps verified at FULL length
    g (fixed verification: dynamic logs are biased); accepted [N] the accepted draft count of
    each step. For k = 1..g in order, with t_1..t_{k-1} frozen, pick t_k from `grid` (default
    `default_temperature_grid`) minimising the ECE of prod_{i<=k} sigmoid(z_i / t_i) against
    A_k = 1[first k accepted]; ties -> the temperature closest to 1. Returns (temps [g] float32,
    report = `calibration_report(conf_logits, accepted, temps)`)."""
    z = np.asarray(conf_logits, np.float64)
    if z.ndim != 2 or z.shape[0] == 0:
        raise ValueError(f"conf_logits must be [N, g] with N > 0, got {z.shape}")
    N, g = z.shape
    A = prefix_outcomes(accepted, g)
    grid = default_temperature_grid() if grid is None else np.asarray(grid, np.float64)
    if grid.ndim != 1 or grid.size == 0 or np.any(grid <= 0):
        raise ValueError("grid must be a non-empty 1-D array of positive temperatures")
    grid = grid[np.argsort(np.abs(np.log(grid)), kind="stable")]   # ties -> closest to 1
    temps = np.ones(g)
    prefix = np.ones(N)
    for k in range(g):
        errs = [ece(prefix * _sigmoid(z[:, k] / t), A[:, k], n_bins) for t in grid]
        temps[k] = grid[int(np.argmin(errs))]
        prefix = prefix * _sigmoid(z[:, k] / temps[k])
    return temps.astype(np.float32), calibration_report(z, accepted, temps, n_bins)


def calibration_report(conf_logits, accepted, temps, n_bins: int = 15) -> dict:
    """Per position k: ECE, AUC and Brier of the cumulative product against A_k, before
    (temperatures 1) and after (`temps`) calibration; plus the base rate of A_k."""
    z = np.asarray(conf_logits, np.float64)
    g = z.shape[1]
    A = prefix_outcomes(accepted, g)
    before = survivals_np(z, np.ones(g))
    after = survivals_np(z, temps)
    rows = []
    for k in range(g):
        rows.append(dict(position=k + 1, temperature=float(np.asarray(temps)[k]),
                         base_rate=float(A[:, k].mean()),
                         ece_before=ece(before[:, k], A[:, k], n_bins),
                         ece_after=ece(after[:, k], A[:, k], n_bins),
                         auc_before=auc(before[:, k], A[:, k]),
                         auc_after=auc(after[:, k], A[:, k]),
                         brier_before=brier(before[:, k], A[:, k]),
                         brier_after=brier(after[:, k], A[:, k])))
    return dict(n=int(z.shape[0]), positions=rows)
