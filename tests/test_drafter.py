"""The drafter interface: every registered drafter, and a toy one defined here, runs through the
one speculative step (`speculative.loop.speculative_step`) of `generate`.

* greedy rows: speculative == plain greedy decoding, token for token (ragged prompts, a stop
  token), for MTP, DSpark and a "repeat the anchor" drafter registered by this file alone;
* sampled rows: the speculative tokens have the plain sampler's distribution (two-sample
  chi-square at several positions, small vocabulary), and the accept path is exercised;
* the toy drafter also runs in the engine (heavy: its own engine programs).

Model: a 1-layer tiny config (sliding-window attention, score-routed MoE) with a 32-token
vocabulary and random weights (few, small programs); the DSpark drafter has random weights too
(losslessness does not depend on draft quality).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deepinfer_fn as di
from deepinfer_fn.config import SCORE_MOE, SWA
from deepinfer_fn.speculative import dspark, registry
from deepinfer_fn.speculative.drafter import Draft, Drafter
from test_speculative import two_sample_p

CFG = di.ModelConfig.preset("tiny", vocab_size=32, num_hidden_layers=1, layer_types=(SWA,),
                            mlp_layer_types=(SCORE_MOE,), max_position_embeddings=256)
N_NEW = 8
N_GREEDY = 4
M = 600            # sampled rows per arm
STOP = 5
K = 3


# --- a toy drafter: the anchor repeated k times ------------------------------------------------


def _resolve(params, weights, num_draft_tokens):
    if weights is not None:
        raise ValueError("the repeat drafter takes no drafter=")
    return None, K if num_draft_tokens is None else int(num_draft_tokens)


def _init_state(params, weights, batch, max_len, *, window_slots, k, dtype):
    return {"committed": jnp.zeros((batch,), jnp.int32)}     # tokens seen (plumbing only)


def _prefill(params, weights, state, lengths, feats, ids, n_new, next_ids, n_next):
    return {"committed": state["committed"] + n_new}


def _draft(params, weights, state, anchor, lengths, sampling, step, active, k, constrain=None):
    if constrain is not None:
        raise NotImplementedError("the repeat drafter does not draft under grammar masks")
    tokens = jnp.repeat(anchor[:, None], k, axis=1)
    V = params.config.vocab_size
    q = jnp.where(jnp.arange(V)[None, None] == tokens[..., None], 0.0, -jnp.inf)  # point mass
    return Draft(tokens.astype(jnp.int32), q, None, state)


def _commit(params, weights, state, feats, tokens, n_emit, lengths, active):
    return {"committed": state["committed"] + n_emit}


REPEAT = Drafter(name="repeat", resolve=_resolve, taps=lambda weights: {},
                 init_state=_init_state, prefill=_prefill, draft=_draft, commit=_commit)


@pytest.fixture(scope="module", autouse=True)
def repeat_registered():
    registry.register(REPEAT)
    yield
    registry.unregister(REPEAT.name)


def drafter_args(name: str) -> dict:
    """generate's speculative keyword arguments per drafter name (a new registered drafter
    needs its entry here)."""
    args = {"mtp": dict(num_draft_tokens=K), "repeat": {},
            "dspark": dict(drafter=dspark.init_dspark(
                CFG, dspark.DSparkConfig.for_target(CFG, block_size=K, markov_rank=8,
                                                    target_layer_ids=(0,)),
                jax.random.key(2)))}
    return args[name]


NAMES = ("mtp", "dspark", "repeat")


def test_every_registered_drafter_is_tested():
    assert set(registry.names()) == set(NAMES)


# --- generate ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs():
    """Rows 0-3: ragged greedy prompts; rows 4..: one prompt sampled at temperature 1 with a
    seed per row (the plain arm uses other seeds, so the arms are independent)."""
    params = di.init_params(CFG, jax.random.key(1))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CFG.vocab_size, (N_GREEDY + M, 12)).astype(np.int32)
    tokens[N_GREEDY:] = tokens[N_GREEDY]
    lengths = np.array([12, 5, 9, 2] + [10] * M, np.int32)
    kw = dict(lengths=lengths, max_new_tokens=N_NEW, stop_tokens=[STOP], pad_id=0,
              temperature=np.array([0.0] * N_GREEDY + [1.0] * M))
    seeds = np.arange(N_GREEDY + M)
    out = {"plain": di.generate(params, tokens, seed=seeds + 10_000, **kw)}
    for name in NAMES:
        out[name] = di.generate(params, tokens, seed=seeds, speculative=name,
                                **drafter_args(name), **kw)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_greedy_equals_plain_greedy(runs, name):
    sp, plain = runs[name], runs["plain"]
    np.testing.assert_array_equal(np.asarray(sp.tokens)[:N_GREEDY],
                                  np.asarray(plain.tokens)[:N_GREEDY])
    np.testing.assert_array_equal(np.asarray(sp.lengths)[:N_GREEDY],
                                  np.asarray(plain.lengths)[:N_GREEDY])
    # every row ends at max_new_tokens or right after the stop token; steps add up
    toks, n = np.asarray(sp.tokens), np.asarray(sp.lengths)
    acc, ver = np.asarray(sp.accepted), np.asarray(sp.verified)
    emitted = np.where(acc >= 0, acc + 1, 0).sum(1)
    for b in range(len(n)):
        stopped = STOP in toks[b, :n[b]]
        assert (toks[b, n[b] - 1] == STOP) if stopped else n[b] == N_NEW
        assert emitted[b] >= n[b] - 1 if stopped else emitted[b] == N_NEW - 1
    assert np.all(acc <= ver) and np.all(ver <= K)
    assert (sp.draft_confidence is not None) == (name == "dspark")


@pytest.mark.parametrize("name", NAMES)
def test_sampled_matches_plain_distribution(runs, name):
    """Two-sample chi-square of the token at several positions (pad = stopped before it)."""
    a = np.asarray(runs[name].tokens)[N_GREEDY:]
    b = np.asarray(runs["plain"].tokens)[N_GREEDY:]
    stats = runs[name].acceptance()
    ps = [two_sample_p(a[:, t], b[:, t]) for t in (1, 3, 5, 7)]
    print(f"\n{name}: {stats}, p-values {np.round(ps, 3).tolist()}")
    assert stats["mean_accepted"] > 0.01          # drafts get accepted: the accept path runs
    assert min(ps) > 0.01


def test_toy_drafter_bad_argument():
    params = di.init_params(CFG, jax.random.key(1))
    with pytest.raises(ValueError, match="repeat drafter takes no drafter"):
        di.generate(params, np.ones((1, 4), np.int32), max_new_tokens=4, speculative="repeat",
                    drafter=object())
    with pytest.raises(ValueError, match="no confidence head"):
        di.generate(params, np.ones((1, 4), np.int32), max_new_tokens=4, speculative="repeat",
                    verify_len="dynamic")


@pytest.mark.heavy   # the engine's own prefill and decode programs
def test_toy_drafter_in_the_engine():
    """The engine's sub-step runs the same step: greedy rows == plain greedy generate."""
    params = di.init_params(CFG, jax.random.key(1))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (12, 5, 9, 2)]
    engine = di.Engine(params, max_batch=4, max_tokens_per_step=32, max_len=64, progress=False,
                       prefill_shapes=((2, 16),), decode_buckets=(4,), speculative="repeat")
    outs = engine.generate([di.Request(p, max_new_tokens=N_NEW, stop_tokens=[STOP])
                            for p in prompts])
    tokens = np.zeros((4, 12), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    plain = di.generate(params, tokens, lengths=[len(p) for p in prompts],
                        max_new_tokens=N_NEW, stop_tokens=[STOP])
    for i, o in enumerate(outs):
        want = np.asarray(plain.tokens)[i, :int(plain.lengths[i])].tolist()
        assert o.tokens == want, i
    assert engine.last_run.spec_row_steps > 0 and engine.last_run.spec_accepted >= 0

