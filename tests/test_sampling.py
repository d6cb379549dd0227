"""Sampler tests: greedy, filters vs a brute-force numpy oracle, goodness of fit, batch invariance,
counter-based keys, grammar masks, validation (deepinfer_fn/sampling.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from deepinfer_fn import sampling as S

sample = jax.jit(S.sample)
probabilities = jax.jit(S.probabilities)
gumbel_noise = jax.jit(S.gumbel_noise, static_argnums=1)

# Small cases go through one compiled shape (compiles dominate this file's run time): the vocab
# is padded with disallowed tokens, the batch with greedy rows.
B_PAD, V_PAD, N_DRAWS = 64, 64, 20000


@jax.jit
def _everything(logits, params, positions, mask):
    tokens, logprobs = S.sample(logits, params, positions, mask)
    return (tokens, logprobs, S.filter_logits(logits, params, mask),
            S.probabilities(logits, params, mask))


def params_rows(rows):
    """SamplingParams from a list of dicts (one per row); missing keys take the 'off' value."""
    get = lambda key, off: [r.get(key, off) for r in rows]
    return S.sampling_params(len(rows), temperature=get("temperature", 0.0), top_k=get("top_k", 0),
                             top_p=get("top_p", 1.0), min_p=get("min_p", 0.0), seed=get("seed", 0))


def run(logits, rows, allowed=None, positions=None):
    """(tokens, logprobs, filtered, probs) of small [B <= 64, V <= 64] inputs, one row per dict."""
    logits = np.atleast_2d(np.asarray(logits, np.float32))
    batch, vocab = logits.shape
    padded = np.zeros((B_PAD, V_PAD), np.float32)
    padded[:batch, :vocab] = logits
    mask = np.zeros((B_PAD, V_PAD), bool)
    mask[:batch, :vocab] = True if allowed is None else allowed
    pos = np.zeros(B_PAD, np.int32)
    pos[:batch] = 0 if positions is None else positions
    out = _everything(jnp.asarray(padded), params_rows(list(rows) + [{}] * (B_PAD - batch)),
                      jnp.asarray(pos), jnp.asarray(mask))
    tokens, logprobs, filtered, probs = (np.asarray(a) for a in out)
    return tokens[:batch], logprobs[:batch], filtered[:batch, :vocab], probs[:batch, :vocab]


def ref_probs(logits, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, allowed=None):
    """Brute force, float64, one row: the distribution the module docstring defines."""
    logits = np.asarray(logits, np.float64).copy()
    vocab = logits.shape[0]
    if allowed is not None:
        logits[~np.asarray(allowed)] = -np.inf
    out = np.zeros(vocab)
    if temperature < S.GREEDY_TEMPERATURE:
        out[int(np.argmax(logits))] = 1.0                    # first maximum = lowest id
        return out
    s = logits / temperature
    p = np.exp(s - s.max())
    p /= p.sum()
    order = sorted(range(vocab), key=lambda v: (-s[v], v))   # descending, ties -> lowest id
    kept = order[:top_k] if top_k > 0 else order
    if top_p < 1.0:
        mass = np.cumsum(p[kept]) / p[kept].sum()            # top-k renormalised
        kept = kept[:int(np.argmax(mass >= top_p)) + 1]       # smallest prefix with mass >= top_p
    kept = [v for v in kept if p[v] >= min_p * p.max()]
    out[kept] = p[kept]
    return out / out.sum()


def draw(logits_row, seed, start=0, allowed=None, positions=None, **row):
    """N_DRAWS draws of one row (V <= 64): the same logits and params in every batch row, at
    positions start, start+1, ... (or `positions`); `seed` a scalar or one per draw."""
    vocab = len(logits_row)
    logits = np.zeros((N_DRAWS, V_PAD), np.float32)
    logits[:, :vocab] = logits_row
    mask = np.zeros((N_DRAWS, V_PAD), bool)
    mask[:, :vocab] = True if allowed is None else allowed
    if positions is None:
        positions = np.arange(start, start + N_DRAWS)
    params = S.sampling_params(N_DRAWS, seed=seed, **row)
    tokens, logprobs = sample(jnp.asarray(logits), params, jnp.asarray(positions, jnp.int32),
                              jnp.asarray(mask))
    return np.asarray(tokens), np.asarray(logprobs)


# ---------------------------------------------------------------------------------------------
# greedy

BIG_ROWS = [dict(temperature=0.0), dict(temperature=0.0, top_k=5, top_p=0.5, seed=3),
            dict(temperature=0.5, top_k=10, top_p=0.9, seed=4), dict(temperature=1.0, top_p=0.5),
            dict(temperature=1.5, top_k=3, seed=1), dict(temperature=0.0, min_p=0.5),
            dict(temperature=0.7, min_p=0.1, seed=9), dict(temperature=1.0, seed=2)]


def test_greedy_is_argmax_and_logprobs_are_raw_model_logprobs():
    """No allowed_mask (the None path), V = 1000."""
    logits = np.random.default_rng(1).normal(size=(8, 1000)).astype(np.float32) * 4
    params = params_rows(BIG_ROWS)
    tokens, logprobs = (np.asarray(a) for a in sample(jnp.asarray(logits), params,
                                                      jnp.arange(8, dtype=jnp.int32)))
    greedy = np.array([r["temperature"] == 0 for r in BIG_ROWS])
    np.testing.assert_array_equal(tokens[greedy], np.argmax(logits, axis=-1)[greedy])
    probs = np.asarray(probabilities(jnp.asarray(logits), params))
    np.testing.assert_array_equal(probs[greedy], np.eye(1000)[np.argmax(logits, axis=-1)][greedy])
    # logprobs: log_softmax of the raw logits at the chosen token, whatever T and the filters.
    l64 = logits.astype(np.float64)
    log_softmax = l64 - l64.max(-1, keepdims=True)
    log_softmax -= np.log(np.exp(log_softmax).sum(-1, keepdims=True))
    np.testing.assert_allclose(logprobs, log_softmax[np.arange(8), tokens], rtol=1e-5)


def test_greedy_ties_go_to_lowest_id():
    logits = np.zeros((3, 16), np.float32)
    logits[:, [3, 7, 12]] = 2.0                                 # three-way tie
    rows = [dict(temperature=0.0), dict(temperature=0.0, seed=5), dict(temperature=1e-7)]
    tokens, logprobs, filtered, probs = run(logits, rows)       # 1e-7 < GREEDY_TEMPERATURE
    np.testing.assert_array_equal(tokens, [3, 3, 3])
    assert np.isfinite(filtered).sum(axis=-1).tolist() == [1, 1, 1]
    assert np.all(filtered[:, 3] == 2.0)
    np.testing.assert_array_equal(probs, np.eye(16)[[3, 3, 3]])
    want = 2.0 - np.log(3 * np.exp(2.0) + 13)                    # raw log-softmax at token 3
    np.testing.assert_allclose(logprobs, want, rtol=1e-6)


def test_temperature_to_zero_limit():
    logits = np.array([1.0, 1.3, 1.2, -0.5, 1.25], np.float32)
    temperatures = [1.0, 0.3, 0.1, 0.03, 1e-3]
    top_mass = [ref_probs(logits, t)[1] for t in temperatures]
    assert np.all(np.diff(top_mass) > 0)                        # mass concentrates on the argmax
    probs = run(np.tile(logits, (5, 1)), [dict(temperature=t) for t in temperatures])[3]
    np.testing.assert_allclose(probs[:, 1], top_mass, rtol=1e-5)
    # T = 1e-3: a 0.05 logit gap is 50 nats, so p is one-hot to 1e-20 and every draw is the argmax.
    np.testing.assert_allclose(probs[-1], np.eye(5)[1], atol=1e-20)
    tokens, _ = draw(logits, seed=3, temperature=1e-3)
    assert np.all(tokens == 1)


# ---------------------------------------------------------------------------------------------
# filters vs brute force

FILTER_ROWS = [
    dict(temperature=1.0), dict(temperature=0.6), dict(temperature=2.0),
    dict(temperature=1.0, top_k=1), dict(temperature=1.0, top_k=7), dict(temperature=0.8, top_k=49),
    dict(temperature=1.0, top_k=50), dict(temperature=1.0, top_k=500),
    dict(temperature=1.0, top_p=0.05), dict(temperature=1.0, top_p=0.63),
    dict(temperature=1.7, top_p=0.91), dict(temperature=0.5, top_p=0.999),
    dict(temperature=1.0, min_p=0.05), dict(temperature=2.0, min_p=0.3),
    dict(temperature=1.2, top_k=20, top_p=0.77), dict(temperature=1.2, top_k=9, top_p=0.97),
    dict(temperature=0.9, top_k=30, top_p=0.85, min_p=0.02), dict(temperature=1.5, top_p=0.7, min_p=0.2),
    dict(temperature=0.0, top_k=5, top_p=0.5, min_p=0.1),
]


@pytest.mark.parametrize("quantised", [False, True], ids=["continuous", "with-ties"])
def test_probabilities_match_brute_force(quantised):
    rng = np.random.default_rng(7)
    rows = FILTER_ROWS * 2
    logits = (rng.normal(size=(len(rows), 50)) * 2.5).astype(np.float32)
    if quantised:                                   # many exact ties: exercises id tie-breaking
        logits = np.round(logits * 2) / 2
    allowed = rng.random(logits.shape) > 0.2
    allowed[: len(FILTER_ROWS)] = True              # first copy unmasked, second copy masked
    _, _, filtered, got = run(logits, rows, allowed)
    for i, row in enumerate(rows):
        want = ref_probs(logits[i], allowed=allowed[i], **row)
        np.testing.assert_array_equal(got[i] > 0, want > 0, err_msg=f"row {i}: {row}")
        np.testing.assert_allclose(got[i], want, rtol=2e-5, atol=1e-7, err_msg=f"row {i}: {row}")
        if row["temperature"] > 0:                  # kept entries are logits / T, others -inf
            np.testing.assert_array_equal(np.isfinite(filtered[i]), want > 0)
            np.testing.assert_allclose(filtered[i][want > 0],
                                       (logits[i] / np.float32(row["temperature"]))[want > 0],
                                       rtol=1e-6)


def test_top_k_keeps_exactly_k_on_ties():
    logits = np.array([1.0, 3.0, 3.0, 3.0, 0.0, 3.0], np.float32)
    probs = run(logits, [dict(temperature=1.0, top_k=2)])[3]
    np.testing.assert_allclose(probs[0], [0, 0.5, 0.5, 0, 0, 0])


def test_top_p_keeps_the_top_token_and_the_smallest_prefix():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    cases = [(0.01, 1), (0.5, 1), (0.51, 2), (0.79, 2), (0.81, 3), (0.96, 4), (1.0, 4)]
    probs = run(np.tile(logits, (len(cases), 1)), [dict(temperature=1.0, top_p=p) for p, _ in cases])[3]
    assert (probs > 0).sum(axis=-1).tolist() == [n for _, n in cases]


# ---------------------------------------------------------------------------------------------
# goodness of fit: empirical vs exact distribution, many positions of one request

def chisquare(counts, expected):
    """Pearson chi-square over the tokens with expected > 0; the rarest tokens are pooled into
    one bin until it expects >= 5 draws."""
    order = np.argsort(expected)
    order = order[expected[order] > 0]
    n_pool = 0 if expected[order[0]] >= 5 else int(np.searchsorted(np.cumsum(expected[order]), 5)) + 1
    pooled = [order[:n_pool]] if n_pool else []
    bins = pooled + [[v] for v in order[n_pool:]]
    obs = np.array([counts[b].sum() for b in bins])
    exp = np.array([expected[b].sum() for b in bins])
    assert exp.min() >= 5 and len(exp) >= 2
    return stats.chisquare(obs, exp * obs.sum() / exp.sum())


GOF_LOGITS = np.array([2.0, 1.5, 1.2, 1.0, 0.5, 0.2, 0.0, -0.3, -1.0, -2.0, -3.0, -5.0], np.float32)
GOF_CASES = {
    "temperature-1": dict(temperature=1.0),
    "temperature-0.7": dict(temperature=0.7),
    "temperature-1.6": dict(temperature=1.6),
    "top-k": dict(temperature=1.0, top_k=5),
    "top-p": dict(temperature=0.9, top_p=0.8),
    "min-p": dict(temperature=1.0, min_p=0.1),
    "combination": dict(temperature=1.3, top_k=8, top_p=0.9, min_p=0.05),
}


@pytest.mark.parametrize("case", GOF_CASES)
def test_goodness_of_fit(case):
    row = GOF_CASES[case]
    tokens, _ = draw(GOF_LOGITS, seed=1234, start=5, **row)
    want = ref_probs(GOF_LOGITS, **row)
    counts = np.bincount(tokens, minlength=len(GOF_LOGITS))
    assert counts[want == 0].sum() == 0, "a filtered-out token was sampled"
    result = chisquare(counts, want * N_DRAWS)
    assert result.pvalue > 0.01, (case, counts, (want * N_DRAWS).round(1), result)


def test_goodness_of_fit_over_seeds():
    """Same position, many seeds (many requests): also the target distribution."""
    row = dict(temperature=1.0, top_p=0.95)
    tokens, _ = draw(GOF_LOGITS, seed=np.arange(N_DRAWS) * 7919 + 11,
                     positions=np.full(N_DRAWS, 42), **row)
    want = ref_probs(GOF_LOGITS, **row)
    counts = np.bincount(tokens, minlength=12)
    assert counts[want == 0].sum() == 0
    assert chisquare(counts, want * N_DRAWS).pvalue > 0.01


# ---------------------------------------------------------------------------------------------
# reproducibility and batch invariance

def test_same_seed_and_position_same_token():
    logits = np.zeros(64, np.float32)                            # uniform: the noise decides
    a, _ = draw(logits, seed=99, temperature=1.0)
    b, _ = draw(logits, seed=99, temperature=1.0)
    np.testing.assert_array_equal(a, b)
    c, _ = draw(logits, seed=100, temperature=1.0)
    assert (a != c).mean() > 0.9                                 # another seed, other tokens
    assert len(np.unique(a[:1000])) == 64                        # positions give fresh noise
    d, _ = draw(logits, seed=99, start=250, temperature=1.0)
    np.testing.assert_array_equal(a[250:], d[:-250])             # the draw is keyed by position


def _row_in_batches(vocab, target, batches, seed=3):
    """The target row's (token, logprob, filtered, probs) in several batches around it."""
    rng = np.random.default_rng(seed)
    row_logits = rng.normal(size=vocab).astype(np.float32) * 3
    row_mask = rng.random(vocab) > 0.1
    results = []
    for others, where in batches:
        rows = others[:where] + [target] + others[where:]
        logits = rng.normal(size=(len(rows), vocab)).astype(np.float32) * 5
        logits[where] = row_logits
        mask = rng.random(logits.shape) > 0.5
        mask[where] = row_mask
        positions = rng.integers(0, 5000, len(rows)).astype(np.int32)
        positions[where] = 1234
        out = _everything(jnp.asarray(logits), params_rows(rows), jnp.asarray(positions),
                          jnp.asarray(mask))
        results.append([np.asarray(a)[where] for a in out])
    return results


# Other rows: none / all greedy / all unfiltered / mixed filters / all sorted.
OTHER_ROWS = [([], 0),
              ([dict(temperature=0.0)] * 3, 2),
              ([dict(temperature=1.0, seed=1)] * 3, 1),
              ([dict(temperature=0.5, top_k=3, seed=2), dict(temperature=2.0, min_p=0.2),
                dict(temperature=1.0, top_p=0.5, seed=5)], 3),
              ([dict(temperature=0.7, seed=i, top_k=i + 1, top_p=0.3 * i + 0.1) for i in range(3)], 0)]
TARGETS = [dict(temperature=1.0, seed=5),                       # no filter: the no-sort path ...
           dict(temperature=0.8, top_p=0.9, seed=6),            # ... and the sorted path
           dict(temperature=1.1, top_k=40, top_p=0.95, min_p=0.01, seed=7),
           dict(temperature=0.0)]                               # greedy


@pytest.mark.parametrize("target", TARGETS)
def test_batch_invariance(target):
    """Token and kept set are bit-identical whatever the batch around the row. (Normalised values
    may differ by an ulp at this small size: XLA:CPU vectorises exp differently for tiny arrays;
    at the real vocabulary they are bit-identical too, next test.)"""
    results = _row_in_batches(777, target, OTHER_ROWS)
    for token, logprob, filtered, probs in results[1:]:
        assert token == results[0][0]
        np.testing.assert_array_equal(filtered, results[0][2])
        np.testing.assert_allclose(logprob, results[0][1], rtol=1e-6)
        np.testing.assert_allclose(probs, results[0][3], rtol=1e-6, atol=0)


def test_batch_invariance_bitwise_at_real_vocabulary():
    batches = [([], 0), ([dict(temperature=0.0), dict(temperature=0.9, top_k=20, seed=4)], 1)]
    for target in (dict(temperature=1.0, min_p=0.001, seed=5), dict(temperature=0.8, top_p=0.9, seed=6)):
        results = _row_in_batches(129280, target, batches)
        for got, want in zip(results[1], results[0]):
            np.testing.assert_array_equal(got, want)


def test_request_key_layout():
    key_data = lambda k: np.asarray(jax.random.key_data(k))
    manual = jax.random.key(5, impl="threefry2x32")
    for data in (7, 0xFFFFFFFF, int(S.Role.GUMBEL), 0xFFFFFFFF):
        manual = jax.random.fold_in(manual, data)
    np.testing.assert_array_equal(key_data(S.request_key(5, 7)), key_data(manual))
    variants = [S.request_key(5, 7), S.request_key(6, 7), S.request_key(5, 8),
                S.request_key(5, 7, step=0), S.request_key(5, 7, slot=0),
                S.request_key(5, 7, step=0, slot=0), S.request_key(5, 7, step=0, slot=1),
                S.request_key(5, 7, role=S.Role.DRAFT), S.request_key(5, 7, role=S.Role.ACCEPT),
                S.request_key(5, None, step=3, role=S.Role.DRAFT, slot=1)]
    datas = {tuple(key_data(k).ravel()) for k in variants}
    assert len(datas) == len(variants)
    # Broadcasting: [B, γ] keys for draft slots; each element equals its scalar key.
    keys = S.request_key(jnp.array([[5], [9]], jnp.uint32), jnp.array([[3], [4]]), step=2,
                         slot=jnp.arange(1, 4), role=S.Role.DRAFT)
    assert keys.shape == (2, 3)
    np.testing.assert_array_equal(key_data(keys[1, 2]),
                                  key_data(S.request_key(9, 4, step=2, slot=3, role=S.Role.DRAFT)))


def test_gumbel_noise_is_per_key():
    keys = S.request_key(jnp.arange(50, dtype=jnp.uint32), 0)
    noise = np.asarray(gumbel_noise(keys, 4001))
    np.testing.assert_array_equal(np.asarray(gumbel_noise(keys[::-1], 4001))[::-1], noise)
    assert np.all(np.isfinite(noise))
    assert abs(noise.mean() - np.euler_gamma) < 0.01 and abs(noise.var() - np.pi**2 / 6) < 0.03
    assert stats.kstest(noise.ravel()[:20000], stats.gumbel_r.cdf).pvalue > 0.01


# ---------------------------------------------------------------------------------------------
# allowed_mask

def test_allowed_mask():
    vocab = 40
    logits = np.random.default_rng(4).normal(size=vocab).astype(np.float32)
    allowed = np.zeros(vocab, bool)
    allowed[[1, 5, 9, 22, 30, 31]] = True
    assert not allowed[np.argmax(logits)]
    tokens, logprobs = draw(logits, seed=8, allowed=allowed, temperature=1.5)
    assert set(np.unique(tokens)) == {1, 5, 9, 22, 30, 31}
    masked = np.where(allowed, logits.astype(np.float64), -np.inf)
    log_softmax = masked - np.log(np.exp(masked[allowed]).sum())
    np.testing.assert_allclose(logprobs, log_softmax[tokens], rtol=1e-5)
    rows = [dict(temperature=0.0), dict(temperature=1.0, top_k=2)]
    greedy, _, _, probs = run(np.tile(logits, (2, 1)), rows, allowed)
    assert greedy[0] == np.argmax(masked)
    assert np.all(probs[:, ~allowed] == 0)
    assert (probs[1] > 0).sum() == 2 and probs[1][np.argmax(masked)] > 0


def test_row_without_allowed_token():
    mask = np.array([[False] * 8, [True] * 8])
    tokens, logprobs, _, probs = run(np.zeros((2, 8)), [dict(temperature=1.0, top_p=0.9, seed=1)] * 2,
                                     mask)
    assert tokens[0] == 0 and logprobs[0] == -np.inf
    assert np.all(probs[0] == 0) and abs(probs[1].sum() - 1) < 1e-6


# ---------------------------------------------------------------------------------------------
# validation

def test_params_broadcast_and_dtypes():
    p = S.sampling_params(3, temperature=[0.0, 0.7, 1.0], top_k=4, top_p=None, min_p=0.05, seed=[1, 2, 3])
    assert p.temperature.dtype == jnp.float32 and p.top_k.dtype == jnp.int32
    assert p.seed.dtype == jnp.uint32 and p.top_p.tolist() == [1.0, 1.0, 1.0]
    assert p.top_k.tolist() == [4, 4, 4] and p.greedy().tolist() == [True, False, False]
    leaves, _ = jax.tree_util.tree_flatten(p)
    assert len(leaves) == 5                                     # a plain pytree: jits and donates


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(temperature=float("nan")), "temperature: values must be finite"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(min_p=1.0), r"min_p must be in \[0, 1\)"),
    (dict(min_p=-0.1), r"min_p must be in \[0, 1\)"),
    (dict(top_k=-1), "top_k must be >= 0"),
    (dict(top_k=2.5), "top_k: values must be integers"),
    (dict(seed=-1), r"seed must be in \[0, 2\*\*32\)"),
    (dict(seed=2**32), r"seed must be in \[0, 2\*\*32\)"),
    (dict(temperature=[0.5, 1.0]), "temperature: expected a scalar or a sequence of length batch=3"),
    (dict(top_k=[1, 2, 3, 4]), "top_k: expected a scalar or a sequence of length batch=3"),
    (dict(seed=[[1, 2, 3]]), "seed: expected a scalar or a sequence of length batch=3"),
    (dict(top_p="high"), "top_p: expected numbers"),
])
def test_validation_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        S.sampling_params(3, **kwargs)


@pytest.mark.parametrize("batch", [0, -2, 2.0, True])
def test_validation_batch(batch):
    with pytest.raises(ValueError, match="batch must be a positive int"):
        S.sampling_params(batch)
