"""Verify-length scheduling (deepinfer_fn/speculative/schedule.py, docs/MODEL.md §D3, §1.5, §2.5).

Model-free and fast:
* padded scheduler: flat cost -> verify everything; steep cost -> shorter; shorter as load
  grows; equals brute force over the column count S when the cost is affine/convex;
  deterministic; inactive rows 0; caps respected; stops at the first bump of a jagged cost;
* packed schedulers: the synchronous early stop equals brute force (affine/convex cost) and
  its allocation equals the device top-(C-R) allocation; tie rule; stale-capacity full search;
* VerifyCost: isotonic fit (vs brute force), interpolation, save/load; measuring it (heavy);
* losslessness through the REAL verifier: the Appendix-A counterexample (early stop -> (0.7,
  0.3); a retrospective scheduler -> (0.85, 0.15), the negative control); a multi-row toy
  whose confidences read the previous draft, under random lengths and every scheduler
  (chi-square of the first two emitted tokens), with negative controls that must be caught
  (reused acceptance uniform, correction drawn from p, a look-ahead scheduler);
* STS calibration: recovers known temperatures, never worsens held-out ECE; metric definitions.
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


def test_knee_tokens():
    cost = sch.VerifyCost.from_tokens([1, 64, 128, 256, 512, 1024],
                                      [1.0, 1.0, 1.01, 1.3, 2.0, 3.4], G)
    assert cost.knee_tokens() == 128          # slope 0.0023 >= half of the last 0.0027
    assert sch.flat_cost(G, batches=(4, 8)).knee_tokens() is None


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


# --- packed layout (§3.3 / §3.4) ---------------------------------------------------------------


def brute_force_packed(a, cap, cost, fixed, active):
    """max over the token budget B of (R + top-B valid survivals) / (fixed + cost(R + B))
    (first maximiser) -> (B, theta); the optimal allocation for a fixed B is the top-B set."""
    R, g = a.shape
    valid = active[:, None] & (np.arange(1, g + 1)[None] <= cap[:, None]) & (a > 0)
    vals = np.sort(a[valid])[::-1]
    n = int(active.sum())
    best, best_B = -1.0, 0
    for B in range(len(vals) + 1):
        theta = (n + vals[:B].sum()) / (fixed + cost(n + B))
        if theta > best * (1 + 1e-9):
            best, best_B = theta, B
    return best_B, vals


_allocate = jax.jit(sch.allocate_topk)


def test_sync_scheduler_matches_brute_force_and_topk():
    """Concave expected tokens / affine-or-convex cost: the early stop is the global optimum;
    its allocation is the top-B set, equal to the device-side allocation with C - R = B."""
    rng = np.random.default_rng(8)
    for trial in range(40):
        R = int(rng.integers(1, 24))
        a = sch.survivals_np(rand_logits(rng, R, loc=rng.normal(0.5, 1)), np.ones(G))
        a[rng.random(a.shape) < 0.05] = 0.5           # ties across requests / slots
        a = np.minimum.accumulate(a, axis=1)
        active = rng.random(R) < 0.9
        cap = rng.integers(0, G + 1, size=R)
        fixed, base, slope = rng.uniform(0, 0.01), rng.uniform(0.005, 0.02), rng.uniform(0, 3e-4)
        cost = (lambda n: base + slope * n) if trial % 2 else (lambda n: base + slope * n * n / 20)
        B, vals = brute_force_packed(a, cap, cost, fixed, active)
        ell = sch.schedule_sync(a, cap, cost, fixed, active=active)
        assert ell.sum() == B, trial
        assert (ell <= np.where(active, cap, 0)).all()
        taken = np.arange(1, G + 1)[None] <= ell[:, None]
        np.testing.assert_allclose(a[taken].sum(), vals[:B].sum(), rtol=1e-12)
        dev = np.asarray(_allocate(a.astype(np.float32), active, cap.astype(np.int32), B))
        np.testing.assert_array_equal(dev, ell, err_msg=f"trial {trial}")


def test_sync_scheduler_regimes():
    rng = np.random.default_rng(9)
    a = sch.survivals_np(rand_logits(rng, 16), np.ones(G))
    flat = sch.schedule_sync(a, np.full(16, G), lambda n: 0.02, 0.005)
    np.testing.assert_array_equal(flat, G)
    knee = lambda n: 0.02 + 3e-4 * max(n - 128, 0)
    means = [sch.schedule_sync(sch.survivals_np(rand_logits(rng, R, loc=0.5), np.ones(G)),
                               np.full(R, G), knee, 0.005).mean() for R in (8, 20, 60, 200)]
    assert means[0] == G and means[-1] < means[0]
    assert all(x >= y for x, y in zip(means, means[1:])), means


def test_allocate_topk_tie_rule_and_prefixes():
    # equal survivals everywhere: ties go to lower slots first, then lower requests
    a = np.ones((3, 4), np.float32)
    got = [np.asarray(_allocate(a, np.ones(3, bool), np.full(3, 4, np.int32), k)).tolist()
           for k in (0, 1, 2, 3, 4, 5, 12, 50)]
    assert got == [[0, 0, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1], [2, 1, 1], [2, 2, 1],
                   [4, 4, 4], [4, 4, 4]]
    rng = np.random.default_rng(10)
    for _ in range(20):
        R = int(rng.integers(1, 30))
        a = sch.survivals_np(rand_logits(rng, R), np.ones(G)).astype(np.float32)
        active, cap = rng.random(R) < 0.8, rng.integers(0, G + 1, R).astype(np.int32)
        k = int(rng.integers(0, R * G + 1))
        ell = np.asarray(_allocate(a, active, cap, k))
        valid = active[:, None] & (np.arange(1, G + 1)[None] <= cap[:, None])
        assert ell.sum() == min(k, valid.sum()) and (ell <= np.where(active, cap, 0)).all()
        taken = np.arange(1, G + 1)[None] <= ell[:, None]
        assert a[taken].min(initial=np.inf) >= a[valid & ~taken].max(initial=-np.inf)


def test_choose_capacity_full_search_jumps_cliffs():
    """Stale survivals + full search over buckets picks the best bucket even behind a cost
    cliff where the early-stopping scan would stop (§3.4)."""
    R = 8
    stale = np.full((R, G), 0.95)
    stale[0] = np.nan                                          # no history: per-slot mean
    cliff = lambda n: 1.0 if n <= R else 1.6                   # step at the first extra token
    buckets = sch.default_buckets(R, G, multiple=16)
    assert buckets[0] == R and buckets[-1] == R * (G + 1)
    C, theta = sch.choose_capacity(stale, np.full(R, G), buckets, cliff, 0.0)
    assert C == R * (G + 1)
    want = [(R + 0.95 * min(b - R, R * G)) / cliff(b) for b in buckets]
    np.testing.assert_allclose(theta, want)
    assert sch.schedule_sync(np.full((R, G), 0.95), np.full(R, G), cliff, 0.0).sum() == 0
    with pytest.raises(ValueError, match="bucket"):
        sch.choose_capacity(stale, np.full(R, G), [R - 1], cliff, 0.0)


# --- losslessness (§2.5, §6.1) ---------------------------------------------------------------

from deepinfer_fn.sampling import SamplingParams  # noqa: E402
from deepinfer_fn.speculative.verify import verify  # noqa: E402
from scipy import stats  # noqa: E402


def _sampling(n, seed0=0):
    return SamplingParams(temperature=jnp.ones((n,)), top_k=jnp.zeros((n,), jnp.int32),
                          top_p=jnp.ones((n,)), min_p=jnp.zeros((n,)),
                          seed=(jnp.arange(n) + seed0).astype(jnp.uint32))


def _logit(c):
    return float(np.log(c) - np.log1p(-c))


# Appendix A: p = (0.7, 0.3) at the first position, q = (0.5, 0.5); SPS(1, 2, 3) =
# (1.0, 0.5, 0.45) steps/s for 1, 2, 3 verify tokens; c_1 = 0.9; c_2 = 0.9 after draft A and
# 0 after draft B.
APPX_P, APPX_Q = np.array([0.7, 0.3]), np.array([0.5, 0.5])
APPX_STEP = np.array([1.0, 1 / 0.5, 1 / 0.45], np.float32)


def retrospective_len(z, step_seconds):
    """A deliberately WRONG scheduler: global argmax over ell of the expected throughput,
    comparing lengths with survivals that already depend on the drafts they admit."""
    a = jnp.cumprod(jax.nn.sigmoid(z), axis=-1)                                # [B,g]
    tau = 1.0 + jnp.concatenate([jnp.zeros(z.shape[:-1] + (1,)), jnp.cumsum(a, -1)], -1)
    return jnp.argmax(tau / step_seconds, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("bad",))
def _appendix_a(drafts, p_logits, q_logits, *, bad):
    n = drafts.shape[0]
    z1 = jnp.full((n,), _logit(0.9))
    z2 = jnp.where(drafts[:, 0] == 0, _logit(0.9), -30.0)                   # c_2 reads x_1
    z = jnp.stack([z1, z2], 1)
    if bad:
        ell = retrospective_len(z, jnp.asarray(APPX_STEP))
    else:  # every request is its own batch of one (R = 1)
        ell = jax.vmap(lambda zr: sch.padded_verify_len(
            zr[None], jnp.ones(2), jnp.ones(1, bool), jnp.full(1, 2), APPX_STEP, 0.0)[0])(z)
    tokens, g = verify(p_logits, drafts, q_logits, _sampling(n), jnp.zeros((n,), jnp.int32), ell)
    return tokens[:, 0], ell, z


def appendix_a(bad, n=60_000):
    drafts = np.random.default_rng(42).choice(2, size=(n, 2), p=APPX_Q).astype(np.int32)
    p_logits = np.broadcast_to(np.log(APPX_P), (n, 3, 2)).astype(np.float32)
    q_logits = np.broadcast_to(np.log(APPX_Q), (n, 2, 2)).astype(np.float32)
    return map(np.asarray, _appendix_a(drafts, p_logits, q_logits, bad=bad))


@pytest.mark.parametrize("bad", [False, True])
def test_appendix_a_counterexample(bad):
    first, ell, z = appendix_a(bad)
    counts = np.bincount(first, minlength=2)
    p_true = stats.chisquare(counts, APPX_P * counts.sum()).pvalue
    print(f"\nAppendix A ({'retrospective' if bad else 'early stop'}): law {counts / counts.sum()}, "
          f"mean ell {ell.mean():.3f}, p vs (0.7, 0.3) = {p_true:.3g}")
    if bad:   # the negative control: biased towards the draft's favourite
        assert p_true < 1e-6
        assert stats.chisquare(counts, np.array([0.85, 0.15]) * counts.sum()).pvalue > 1e-3
        assert set(np.unique(ell)) == {0, 2}
    else:
        assert p_true > 1e-3
        # the host scheduler agrees with the jitted one on these rows
        a = sch.survivals_np(z[:200], np.ones(2))
        host = [sch.schedule_sync(a[i:i + 1], [2], lambda b: APPX_STEP[b - 1], 0.0)[0]
                for i in range(200)]
        np.testing.assert_array_equal(host, ell[:200])


# --- STS calibration (§1.5) ------------------------------------------------------------------


def synthetic_log(rng, n, true_temps, loc=1.0, scale=1.5):
    """Steps verified at full length: true conditional acceptance c_k = sigmoid(s_k), the head
    reports z_k = T_k * s_k (T > 1: over-confident); accepted = first failure."""
    g = len(true_temps)
    s = rng.normal(loc, scale, size=(n, g))
    ok = rng.random((n, g)) < 1 / (1 + np.exp(-s))
    accepted = np.argmin(np.c_[ok, np.zeros(n, bool)], axis=1)
    return s * np.asarray(true_temps), accepted


def test_sts_recovers_known_temperatures():
    true = np.array([2.0, 1.5, 3.0, 1.0, 2.5])
    z, acc = synthetic_log(np.random.default_rng(11), 100_000, true)
    temps, report = sch.sts_calibrate(z, acc)
    assert temps.shape == (G,)
    np.testing.assert_allclose(np.log(temps), np.log(true), atol=np.log(1.16))
    for row in report["positions"]:
        assert row["ece_after"] < row["ece_before"]
        assert row["ece_after"] < 0.02
        assert abs(row["auc_after"] - row["auc_before"]) < 0.03   # ranking (nearly) kept


@pytest.mark.parametrize("true", [(1.0,) * 5, (0.5, 0.7, 1.0, 1.5, 4.0), (3.0,) * 5])
def test_sts_never_worsens_held_out_ece(true):
    rng = np.random.default_rng(12)
    z, acc = synthetic_log(rng, 40_000, true, loc=rng.normal(1, 0.5))
    temps, _ = sch.sts_calibrate(z[:20_000], acc[:20_000])
    held = sch.calibration_report(z[20_000:], acc[20_000:], temps)
    for row in held["positions"]:
        assert row["ece_after"] <= row["ece_before"] + 0.005, row


def test_calibration_metrics_against_definitions():
    rng = np.random.default_rng(13)
    p, y = rng.random(500), rng.random(500) < 0.4
    pairs = np.mean([(pi > pj) + 0.5 * (pi == pj) for pi in p[y] for pj in p[~y]])
    assert abs(sch.auc(p, y) - pairs) < 1e-12
    assert abs(sch.auc(np.round(p, 1), y) -
               np.mean([(pi > pj) + 0.5 * (pi == pj) for pi in np.round(p, 1)[y]
                        for pj in np.round(p, 1)[~y]])) < 1e-12
    bins = np.minimum((p * 15).astype(int), 14)
    want = sum(abs(p[bins == b].sum() - y[bins == b].sum()) for b in range(15)) / 500
    assert abs(sch.ece(p, y) - want) < 1e-12
    with pytest.raises(ValueError, match="accepted"):
        sch.sts_calibrate(np.zeros((3, 2)), np.array([0, 3, 1]))


# Multi-row toy: bigram target P [V,V] and draft Q [V,V] over V = 4 tokens, anchor 0, g = 3
# drafts per row, confidences that read the previous draft (as DSpark's do). The first two
# emitted tokens must follow p(e1 | 0) p(e2 | e1) whatever the verify lengths, as long as they
# are decided non-anticipatingly; rows that emit one token get e2 from a plain draw.
TV, TG, TROWS, TR = 4, 3, 48_000, 4          # vocab, drafts, rows, rows per scheduling group


def _toy_setup(seed=21):
    rng = np.random.default_rng(seed)
    P = 1.5 * rng.normal(size=(TV, TV))
    Q = P + 1.2 * rng.normal(size=(TV, TV))
    soft = lambda x: np.exp(x - x.max(-1, keepdims=True)) / np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)
    x = np.zeros((TROWS, TG + 1), np.int64)                       # x[:, 0] = anchor 0
    for j in range(1, TG + 1):
        cdf = np.cumsum(soft(Q[x[:, j - 1]]), -1)
        x[:, j] = np.minimum((rng.random((TROWS, 1)) > cdf).sum(-1), TV - 1)
    conf_table = rng.normal(1.0, 1.5, size=TV)
    z = conf_table[x[:, :TG]] + 0.5 * rng.normal(size=(TROWS, TG))  # z_j reads x_{j-1}
    plain_u = rng.random(TROWS)
    return dict(P=P, Q=Q, x=x, z=z.astype(np.float32), plain_u=plain_u, p=soft(P),
                drafts=x[:, 1:].astype(np.int32),
                p_logits=P[x].astype(np.float32),                  # o_j = P[token j]
                q_logits=Q[x[:, :TG]].astype(np.float32))


def _toy_emitted(toy, tokens, g):
    e1 = tokens[:, 0]
    cdf = np.cumsum(toy["p"][e1], -1)
    plain = np.minimum((toy["plain_u"][:, None] > cdf).sum(-1), TV - 1)
    e2 = np.where(g >= 1, tokens[:, 1], plain)
    counts = np.zeros((TV, TV))
    np.add.at(counts, (e1, e2), 1)
    joint = toy["p"][0][:, None] * toy["p"]
    return stats.chisquare(counts.ravel(), joint.ravel() * counts.sum()).pvalue


def _toy_ell(toy, how):
    z = toy["z"]
    groups = z.reshape(-1, TR, TG)
    step = np.float32(0.01) * (1 + 0.35 * np.arange(TG + 1, dtype=np.float32))
    if how == "random":
        return np.random.default_rng(5).integers(0, TG + 1, TROWS).astype(np.int32)
    if how == "padded":
        f = jax.jit(jax.vmap(lambda zg: sch.padded_verify_len(
            zg, jnp.ones(TG), jnp.ones(TR, bool), jnp.full(TR, TG), step, 0.0)))
        return np.asarray(f(groups)).ravel()
    if how == "topk":       # capacity fixed beforehand (stale information): random per group
        k = np.random.default_rng(6).integers(0, TR * TG + 1, len(groups)).astype(np.int32)
        a = jax.vmap(lambda zg: sch.survivals(zg, jnp.ones(TG)))(groups)
        f = jax.jit(jax.vmap(lambda ag, kg: sch.allocate_topk(ag, jnp.ones(TR, bool),
                                                              jnp.full(TR, TG), kg)))
        return np.asarray(f(a, k)).ravel()
    if how == "sync":
        a = sch.survivals_np(z, np.ones(TG)).reshape(-1, TR, TG)
        cost = lambda n: 0.004 + 0.0025 * n
        return np.concatenate([sch.schedule_sync(ag, np.full(TR, TG), cost, 0.0) for ag in a])
    raise ValueError(how)


_verify_jit = jax.jit(verify)


@pytest.mark.parametrize("how", ["random", "padded", "topk", "sync"])
def test_verifier_lossless_under_schedulers(how):
    """The real verifier with per-row verify lengths from each scheduler (or drawn at random,
    independently of the drafts) emits the target's joint law of the first two tokens."""
    toy = _toy_setup()
    ell = _toy_ell(toy, how).astype(np.int32)
    assert 0 < ell.mean() < TG and len(np.unique(ell)) > 1        # the lengths really vary
    tokens, g = map(np.asarray, _verify_jit(toy["p_logits"], toy["drafts"], toy["q_logits"],
                                            _sampling(TROWS, 1000),
                                            jnp.zeros((TROWS,), jnp.int32), ell))
    p = _toy_emitted(toy, tokens, g)
    print(f"\n{how}: mean ell {ell.mean():.2f}, mean accepted {g.mean():.2f}, p = {p:.3g}")
    assert p > 1e-3


def _buggy_verify(p_logits, q_logits, drafts, ell, seeds, bug):
    """A test-only sampled verifier with a deliberate bug (negative controls): 'reuse' draws one
    acceptance uniform per row for all slots; 'p_correction' draws the correction from p instead
    of the residual max(p - q, 0)."""
    n, K1, V = p_logits.shape
    k = K1 - 1
    keys = jax.vmap(jax.random.key)(seeds)
    u = jax.vmap(lambda kk: jax.random.uniform(jax.random.fold_in(kk, 0), (k,)))(keys)
    if bug == "reuse":
        u = jnp.broadcast_to(u[:, :1], u.shape)
    p = jax.nn.softmax(p_logits, -1)
    q = jax.nn.softmax(q_logits, -1)
    px = jnp.take_along_axis(p[:, :k], drafts[..., None], -1)[..., 0]
    qx = jnp.take_along_axis(q, drafts[..., None], -1)[..., 0]
    acc = (u * qx < px) & (jnp.arange(k)[None] < ell[:, None])
    g = jnp.sum(jnp.cumprod(acc.astype(jnp.int32), 1), 1)
    pg = jnp.take_along_axis(p, g[:, None, None], 1)[:, 0]
    qg = jnp.take_along_axis(q, jnp.minimum(g, k - 1)[:, None, None], 1)[:, 0]
    w = jnp.where((g < ell)[:, None] & (bug != "p_correction"), jnp.maximum(pg - qg, 0), pg)
    w = jnp.where(w.sum(-1, keepdims=True) > 0, w, pg)
    final = jax.vmap(lambda kk, ww: jax.random.categorical(jax.random.fold_in(kk, 1),
                                                           jnp.log(ww)))(keys, w)
    j = jnp.arange(K1)[None]
    padded_d = jnp.concatenate([drafts, jnp.zeros((n, 1), jnp.int32)], 1)
    tokens = jnp.where(j < g[:, None], padded_d, jnp.where(j == g[:, None], final[:, None], 0))
    return tokens, g


def test_negative_controls_are_detected():
    """Same harness, random verify lengths: the bug-free test verifier passes, a reused
    acceptance uniform and a correction drawn from p both fail (the test has power)."""
    toy = _toy_setup()
    ell = _toy_ell(toy, "random")
    seeds = np.arange(TROWS, dtype=np.uint32) + 7
    ps = {}
    for bug in ("none", "reuse", "p_correction"):
        f = jax.jit(functools.partial(_buggy_verify, bug=bug))
        tokens, g = map(np.asarray, f(toy["p_logits"], toy["q_logits"], toy["drafts"], ell, seeds))
        ps[bug] = _toy_emitted(toy, tokens, g)
    print(f"\nnegative controls: {ps}")
    assert ps["none"] > 1e-3
    assert ps["reuse"] < 1e-6 and ps["p_correction"] < 1e-6


def test_retrospective_scheduler_detected_by_real_verifier():
    """The multi-row harness also catches a scheduler that looks ahead (each row's global
    argmax over its verify length, whose survivals read the drafts they admit), while the
    early-stopping scheduler on the same confidences and costs stays lossless. Confidences
    as in Appendix A: high after some tokens, ~0 after the others."""
    toy = _toy_setup()
    z = np.asarray([2.2, -6.0, 2.2, -6.0], np.float32)[toy["x"][:, :TG]]
    step = np.asarray([1.0, 2.0, 2.2, 2.4], np.float32)
    early = jax.jit(jax.vmap(lambda zr: sch.padded_verify_len(
        zr[None], jnp.ones(TG), jnp.ones(1, bool), jnp.full(1, TG), step, 0.0)[0]))
    ps = {}
    for name, ell in (("retrospective", jax.jit(retrospective_len)(z, jnp.asarray(step))),
                      ("early stop", early(z))):
        ell = np.asarray(ell).astype(np.int32)
        tokens, g = map(np.asarray, _verify_jit(toy["p_logits"], toy["drafts"], toy["q_logits"],
                                                _sampling(TROWS, 1000),
                                                jnp.zeros((TROWS,), jnp.int32), ell))
        ps[name] = _toy_emitted(toy, tokens, g)
        print(f"\n{name}: ell histogram {np.bincount(ell, minlength=TG + 1)}, p = {ps[name]:.3g}")
    assert ps["retrospective"] < 1e-6
    assert ps["early stop"] > 1e-3


def test_run_with_columns_runs_only_s_columns():
    """The branch for S sees exactly ids[:, :S]; per-token outputs are padded back to K with
    zeros; the S-independent part passes through; S = 1 + max active ell."""
    K = 4
    ids = jnp.arange(3 * K, dtype=jnp.int32).reshape(3, K) + 1

    def fn(ids_s):
        per_token = {"x": ids_s * 10, "y": jnp.stack([ids_s, -ids_s], -1)}
        return per_token, jnp.sum(ids_s, axis=1) + 100 * ids_s.shape[1]

    f = jax.jit(lambda ids, s: sch.run_with_columns(fn, ids, s))
    for S in range(1, K + 1):
        (tok, rest) = f(ids, jnp.int32(S))
        want = np.where(np.arange(K)[None] < S, np.asarray(ids), 0)
        np.testing.assert_array_equal(tok["x"], want * 10)
        np.testing.assert_array_equal(tok["y"][..., 1], -want)
        np.testing.assert_array_equal(rest, want.sum(1) + 100 * S)
    ell = jnp.asarray([0, 2, 3]), jnp.asarray([True, True, False])
    assert int(sch.verify_columns(*ell)) == 3
    assert int(sch.verify_columns(jnp.zeros(3, jnp.int32), jnp.zeros(3, bool))) == 1


def test_column_buckets_and_bucketed_run():
    """Only widths where the profile gets >= 10% cheaper are compiled; S columns run on the
    smallest bucket >= S (brute force over every S), and the scheduler sees that bucket's cost."""
    assert sch.column_buckets([1.0] * 6) == (6,)                       # flat: nothing to gain
    assert sch.column_buckets([1, 2, 3, 4, 5, 6]) == (1, 2, 3, 4, 5, 6)  # steep: every width
    h200 = [1.397e-3, 1.397e-3, 1.397e-3, 1.487e-3, 1.499e-3, 3.043e-3]   # measured, B = 16
    assert sch.column_buckets(h200) == (5, 6)
    assert sch.column_buckets(h200, rel_tol=0.05) == (3, 5, 6)
    np.testing.assert_allclose(sch.bucketed_seconds(h200, (5, 6)), [1.499e-3] * 5 + [3.043e-3])
    for buckets in ((6,), (2, 6), (1, 3, 5, 6)):
        sec = np.arange(1.0, 7.0)
        got = sch.bucketed_seconds(sec, buckets)
        want = [sec[min(b for b in buckets if b >= s) - 1] for s in range(1, 7)]
        np.testing.assert_array_equal(got, want)
    K = 6
    ids = jnp.arange(2 * K, dtype=jnp.int32).reshape(2, K) + 1
    fn = lambda ids_s: ((ids_s * 3,), 100 * ids_s.shape[1])
    for buckets in ((K,), (2, 4, K)):
        f = jax.jit(lambda ids, s: sch.run_with_columns(fn, ids, s, buckets))
        for S in range(1, K + 1):
            (tok,), rest = f(ids, jnp.int32(S))
            width = min(b for b in buckets if b >= S)
            assert int(rest) == 100 * width
            np.testing.assert_array_equal(tok, np.where(np.arange(K) < width, np.asarray(ids) * 3, 0))
    with pytest.raises(ValueError, match="ending at K"):
        sch.run_with_columns(fn, ids, 3, (2, 4))


@pytest.mark.heavy
def test_measure_verify_times_in_a_device_loop():
    """The profile measurement: shapes and positivity for both modes, and the looped program
    really runs n full verify forwards from the same state (rolled back after each): its
    argmax checksum is n x the single forward's, and the state it returns is unchanged."""
    import deepinfer_fn as di
    from deepinfer_fn.generate import prefill
    from deepinfer_fn.state import init_state

    params = di.init_params(di.ModelConfig.preset("tiny", num_mtp_layers=0), jax.random.key(0))
    cfg = params.config
    sec = sch.measure_verify_times(params, [2], [1, 3], context=12, repeats=2, warmup=1,
                                   in_loop=3)
    assert sec.shape == (1, 2) and np.all(np.isfinite(sec)) and np.all(sec > 0)
    cost = sch.measure_verify_cost(params, [2], 1, context=12, repeats=1, warmup=0, in_loop=0)
    assert cost.meta["in_loop"] == 0 and cost.seconds.shape == (1, 2)

    B, S, n = 2, 3, 4
    state = init_state(cfg, B, 32, window_slots=cfg.sliding_window + S)
    prompt = np.asarray(jax.random.randint(jax.random.key(1), (B, 12), 2, cfg.vocab_size))
    _, state = prefill(params, state, prompt, np.full((B,), 12, np.int32), 12)
    ids = jax.random.randint(jax.random.key(2), (B, S), 2, cfg.vocab_size)
    n_new = jnp.full((B,), S, jnp.int32)
    one = jax.jit(sch.verify_forward_program(1, looped=False))
    loop = jax.jit(sch.verify_forward_program(n, looped=True))
    single, after_one = one(params, state, ids, n_new, state.lengths)
    total, after_loop = loop(params, state, ids, n_new, state.lengths)
    assert int(total) == n * int(single) != 0
    np.testing.assert_array_equal(after_loop.lengths, state.lengths)
    np.testing.assert_array_equal(after_one.lengths, state.lengths + S)
    # what the forwards wrote is the same whether it ran once or n times
    for a, b in zip(jax.tree.leaves(after_loop), jax.tree.leaves(after_one)):
        if a.shape != state.lengths.shape:
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                       rtol=1e-5, atol=1e-5)
