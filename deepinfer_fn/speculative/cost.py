"""The verify forward's measured cost (docs/MODEL.md §D3.1): `VerifyCost`, time vs (batch rows,
columns) or vs tokens, isotonic in the columns, interpolated between measured batches,
saved/loaded as JSON. `measure.measure_verify_cost` builds one on the current device."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

import numpy as np


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


@dataclasses.dataclass(frozen=True)
class VerifyCost:
    """Measured verify forward time (docs/MODEL.md §D3.1).

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


def cost_function(verify_seconds):
    """tokens -> seconds from a callable, a `VerifyCost` (its token curve), or an array indexed
    by the token count."""
    if isinstance(verify_seconds, VerifyCost):
        return lambda n: float(verify_seconds.seconds_at_tokens(n))
    if callable(verify_seconds):
        return lambda n: float(verify_seconds(n))
    table = np.asarray(verify_seconds, np.float64)
    return lambda n: float(table[int(n)])
