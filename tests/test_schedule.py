"""Verify-length scheduling (deepinfer_fn/speculative/schedule.py, spec/dspark.md §3, §1.5, §2.5).

Model-free and fast:
* padded scheduler: flat cost -> verify everything; steep cost -> shorter; shorter as load
  grows; equals brute force over the column count S when the cost is affine/convex;
  deterministic; inactive rows 0; caps respected;
* VerifyCost: isotonic fit, interpolation, save/load;
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_fn.speculative import schedule as sch

G = 5


@jax.jit
def _padded(z, temps, active, cap, step_seconds, overhead, eps):
    return sch.padded_verify_len(z, temps, active, cap, step_seconds, overhead, eps)


def padded(z, step_seconds, overhead=0.0, eps=0.0, active=None, cap=None, temps=None):
    z = np.asarray(z, np.float32)
    B, g = z.shape
    active = np.ones(B, bool) if active is None else np.asarray(active)
    cap = np.full(B, g, np.int32) if cap is None else np.asarray(cap, np.int32)
    temps = np.ones(g, np.float32) if temps is None else np.asarray(temps, np.float32)
    return np.asarray(_padded(z, temps, active, cap, np.asarray(step_seconds, np.float32),
                              np.float32(overhead), np.float32(eps)))


def brute_force_S(z, step_seconds, overhead, active, cap):
    """argmax over S = 1..g+1 of the padded throughput (first maximiser), float64."""
    a = sch.survivals_np(z, np.ones(z.shape[1]))
    g = z.shape[1]
    best, best_S = -1.0, 1
    for S in range(1, g + 2):
        tau = sum(1 + a[r, :min(S - 1, cap[r])].sum() for r in range(len(z)) if active[r])
        theta = tau / (overhead + step_seconds[S - 1])
        if theta > best * (1 + 1e-6):
            best, best_S = theta, S
    return best_S


def rand_logits(rng, B, g=G, loc=1.0):
    return rng.normal(loc, 1.5, size=(B, g)).astype(np.float32)


# --- padded scheduler ----------------------------------------------------------------------


def test_flat_cost_verifies_everything():
    rng = np.random.default_rng(0)
    z = rand_logits(rng, 16, loc=-1.0)            # even low-confidence drafts are free
    ell = padded(z, np.full(G + 1, 0.02), overhead=0.01)
    np.testing.assert_array_equal(ell, G)


def test_steep_cost_verifies_less():
    rng = np.random.default_rng(1)
    z = rand_logits(rng, 16)
    steep = 0.01 * np.arange(1, G + 2)            # every column costs as much as the first
    ell = padded(z, steep, overhead=0.0)
    assert ell.max() < G
    flat = padded(z, np.full(G + 1, 0.01))
    assert (ell <= flat).all() and ell.sum() < flat.sum()


def test_shorter_as_load_grows():
    """Cost flat up to a knee of 128 tokens, then linear: ell shrinks as the batch grows."""
    rng = np.random.default_rng(2)
    cost = sch.VerifyCost.from_tokens([1, 128, 4096], [0.02, 0.02, 0.02 + 3968 * 3e-4], G)
    lens = []
    for B in (4, 16, 60, 200):
        z = rand_logits(rng, B, loc=0.5)
        lens.append(padded(z, cost.step_seconds_for(B), overhead=0.005).mean())
    assert lens[0] == G
    assert all(x >= y for x, y in zip(lens, lens[1:])), lens
    assert lens[-1] < lens[0]


@pytest.mark.parametrize("shape", ["affine", "convex"])
def test_matches_brute_force(shape):
    rng = np.random.default_rng(3)
    for trial in range(40):
        B = int(rng.integers(1, 40))
        z = rand_logits(rng, B, loc=rng.normal(0, 1.5))
        active = rng.random(B) < 0.85
        cap = rng.integers(0, G + 1, size=B)
        cols = np.arange(1, G + 2)
        base, slope = rng.uniform(0.005, 0.05), rng.uniform(0, 0.02) * B / 16
        step = base + slope * (cols - 1) if shape == "affine" else \
            base + slope * (cols - 1) ** 2 / 2
        overhead = rng.uniform(0, 0.02)
        S = brute_force_S(z, step, overhead, active, cap)
        ell = padded(z, step, overhead, active=active, cap=cap)
        np.testing.assert_array_equal(ell, np.where(active, np.minimum(S - 1, cap), 0),
                                      err_msg=f"trial {trial}")


def test_jagged_cost_stops_at_first_bump():
    """Early stopping is a local rule: a cost cliff at S = 2 stops the scan even when S = 6
    would be better (the price of losslessness without stale information, §3.3)."""
    z = np.full((8, G), 4.0, np.float32)          # near-certain drafts
    step = np.array([1.0, 3.0, 3.0, 3.0, 3.0, 3.0])
    assert brute_force_S(z, step, 0.0, np.ones(8, bool), np.full(8, G)) == G + 1
    np.testing.assert_array_equal(padded(z, step), 0)


def test_inactive_rows_and_caps():
    rng = np.random.default_rng(4)
    z = rand_logits(rng, 12, loc=3.0)
    active = np.array([True, False] * 6)
    cap = np.array([0, 5, 1, 5, 2, 5, 3, 5, 4, 5, 5, 5])
    ell = padded(z, np.full(G + 1, 0.01), active=active, cap=cap)
    np.testing.assert_array_equal(ell, np.where(active, cap, 0))
    # no active row at all: everything 0
    np.testing.assert_array_equal(padded(z, np.full(G + 1, 0.01), active=np.zeros(12, bool)), 0)


def test_deterministic_and_batch_order_equivariant():
    rng = np.random.default_rng(5)
    z = rand_logits(rng, 30)
    step = 0.01 + 0.004 * np.arange(G + 1)
    a = padded(z, step, 0.003)
    np.testing.assert_array_equal(a, padded(z, step, 0.003))
    perm = rng.permutation(30)
    np.testing.assert_array_equal(a[perm], padded(z[perm], step, 0.003))


def test_temperature_and_eps():
    """Larger STS temperatures flatten over-confident logits (shorter verify); a larger eps
    never verifies more."""
    rng = np.random.default_rng(6)
    z = rand_logits(rng, 32, loc=2.0)
    step = 0.01 + 0.003 * np.arange(G + 1)
    hot = padded(z, step, temps=np.full(G, 4.0))
    cold = padded(z, step)
    assert hot.sum() <= cold.sum()
    for eps in (0.01, 0.05, 0.5):
        assert (padded(z, step, eps=eps) <= cold).all()


def test_bad_step_seconds_shape():
    with pytest.raises(ValueError, match="step_seconds"):
        sch.padded_verify_len(np.zeros((2, G)), np.ones(G), np.ones(2, bool), np.full(2, G),
                              np.ones(G), 0.0)


# --- VerifyCost ------------------------------------------------------------------------------


def test_isotonic_matches_brute_force():
    """PAVA against a brute-force projection (small n: enumerate all block partitions)."""
    rng = np.random.default_rng(7)
    import itertools
    for _ in range(30):
        n = int(rng.integers(1, 7))
        y, w = rng.normal(size=n), rng.uniform(0.5, 2, size=n)
        best = None
        for cuts in itertools.product([0, 1], repeat=n - 1):
            blocks, start = [], 0
            for i, c in enumerate(cuts + (1,)):
                if c:
                    blocks.append(slice(start, i + 1))
                    start = i + 1
            fit = np.concatenate([np.full(b.stop - b.start, np.average(y[b], weights=w[b]))
                                  for b in blocks])
            if np.all(np.diff(fit) >= -1e-12):
                err = np.sum(w * (fit - y) ** 2)
                if best is None or err < best[0] - 1e-12:
                    best = (err, fit)
        np.testing.assert_allclose(sch.isotonic_increasing(y, w), best[1], atol=1e-9)


def test_verify_cost_fit_interp_and_save(tmp_path):
    raw = np.array([[1.0, 1.2, 1.1, 1.5, 1.6, 1.9],
                    [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    cost = sch.VerifyCost.from_grid([8, 32], raw, overhead_seconds=0.25, meta={"device": "x"})
    assert np.all(np.diff(cost.seconds, axis=1) >= 0)
    assert np.all(np.diff(cost.seconds, axis=0) >= 0)
    np.testing.assert_allclose(cost.seconds[0, 1:3], 1.15)
    np.testing.assert_allclose(cost.step_seconds_for(32), raw[1], rtol=1e-6)
    mid = cost.step_seconds_for(20)                                     # halfway
    np.testing.assert_allclose(mid, (cost.seconds[0] + cost.seconds[1]) / 2, rtol=1e-6)
    big = cost.step_seconds_for(64)                                     # extrapolated
    assert np.all(np.diff(big) >= 0) and big[-1] > raw[1, -1]
    cost.save(tmp_path / "c.json")
    back = sch.VerifyCost.load(tmp_path / "c.json")
    assert back.overhead_seconds == 0.25 and back.meta == {"device": "x"}
    for b in (1, 8, 13, 32, 100):
        np.testing.assert_array_equal(back.step_seconds_for(b), cost.step_seconds_for(b))
    with pytest.raises(ValueError, match="seconds"):
        sch.VerifyCost("grid", 5, (8,), np.ones((1, 3)))
    with pytest.raises(ValueError, match="batch"):
        cost.step_seconds_for(0)
