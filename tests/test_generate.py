"""Decode state and generate(): incremental decoding equals the no-cache forward, ragged
batches equal single prompts, greedy equals the forward argmax roll-out, sampling is seeded
and batch-independent, bad input is rejected."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deepinfer_fn as di
from conftest import golden_params, rel_err
from deepinfer_fn.model import transformer
from deepinfer_fn.state import init_state

TOL = 1e-4
CAPACITY = 256


@functools.partial(jax.jit, static_argnames=("all_logits",))
def _chunk(params, state, ids, n_new, all_logits=True):
    return transformer.forward_chunk(params, state, ids, n_new, all_logits=all_logits)[:2]


def _prefill_then_decode(params, ids, chunk, prompt_len):
    """Prefill the first `prompt_len` tokens in chunks of `chunk`, then decode the rest one
    token at a time; all logits [B,T,V]."""
    B, T = ids.shape
    state = init_state(params.config, B, CAPACITY)
    outs = []
    padded = np.pad(ids, ((0, 0), (0, chunk)))
    for off in range(0, prompt_len, chunk):
        n = min(chunk, prompt_len - off)
        logits, state = _chunk(params, state, jnp.asarray(padded[:, off:off + chunk]),
                               jnp.full((B,), n, jnp.int32))
        outs.append(np.asarray(logits)[:, :n])
    for t in range(prompt_len, T):
        logits, state = _chunk(params, state, jnp.asarray(ids[:, t:t + 1]), jnp.ones((B,), jnp.int32))
        outs.append(np.asarray(logits))
    return np.concatenate(outs, 1), state


# (7, cfg_a) and (128, cfg_c) in the default suite; the other four pairs are `heavy` (each
# compiles its own prefill/decode programs, ~0.5-1 min on 2 cores; CI runs them too).
@pytest.mark.parametrize("chunk,name", [
    pytest.param(c, n, marks=() if (c, n) in ((7, "cfg_a"), (128, "cfg_c")) else pytest.mark.heavy)
    for n in ("cfg_a", "cfg_c") for c in (1, 7, 128)])
def test_chunked_prefill_then_decode_equal_forward(chunk, name, golden):
    """Prefill(P = 45) in chunks of 1 (pure token-by-token), 7 (crossing every CSA/HCA block
    boundary mid-chunk) or 128 (one shot), then single-token decode to the end: the logits at
    every position equal the transformers reference (prompt and decoded tokens both cross
    compression-block boundaries: CSA 4, HCA 16 / 8, window 8 / 16)."""
    ref = golden(name)
    got, state = _prefill_then_decode(golden_params(name), ref["input_ids"], chunk, 45)
    err = rel_err(got, ref["logits"])
    print(f"\nDECODE {name} prefill chunk={chunk}: {err:.2e}")
    assert err <= TOL
    assert np.all(np.asarray(state.lengths) == ref["input_ids"].shape[1])


def test_prefill_then_multi_token_decode_equals_single_token(golden):
    """k-token decode (draft verification) equals k single-token steps, state included."""
    params, ids = golden_params("cfg_a"), golden("cfg_a")["input_ids"]
    B = ids.shape[0]
    state = init_state(params.config, B, CAPACITY)
    _, state = _chunk(params, state, jnp.asarray(ids[:, :45]), jnp.full((B,), 45, jnp.int32))
    one = state
    singles = []
    for t in range(45, 50):
        lg, one = _chunk(params, one, jnp.asarray(ids[:, t:t + 1]), jnp.ones((B,), jnp.int32))
        singles.append(np.asarray(lg)[:, 0])
    multi, many = _chunk(params, state, jnp.asarray(ids[:, 45:50]), jnp.full((B,), 5, jnp.int32))
    np.testing.assert_allclose(np.asarray(multi), np.stack(singles, 1), rtol=0, atol=2e-5)
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(many)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-5)


def test_ragged_rows_in_one_chunk(golden):
    """Rows advancing by different amounts in one call (n_new 5 and 0) keep exact states."""
    params, ids = golden_params("cfg_a"), golden("cfg_a")["input_ids"]
    want = golden("cfg_a")["logits"]
    state = init_state(params.config, 2, CAPACITY)
    _, state = _chunk(params, state, jnp.asarray(ids[:, :40]), jnp.asarray([40, 33], jnp.int32))
    lg, state = _chunk(params, state, jnp.asarray(np.stack([ids[0, 40:45], ids[1, 33:38]])),
                       jnp.asarray([5, 0], jnp.int32))
    assert rel_err(np.asarray(lg)[0], want[0, 40:45]) <= TOL
    lg, state = _chunk(params, state, jnp.asarray(np.stack([ids[0, 45:50], ids[1, 33:38]])),
                       jnp.asarray([0, 5], jnp.int32))
    assert rel_err(np.asarray(lg)[1], want[1, 33:38]) <= TOL
    assert np.asarray(state.lengths).tolist() == [45, 38]


def _argmax_rollout(params, prompt, n, width=64):
    """Greedy roll-out with the no-cache forward; the sequence is right-padded to a fixed
    width (causal attention: padding after position t cannot change logits at t), so one
    compiled forward serves every step."""
    seq = list(prompt)
    for _ in range(n):
        buf = np.zeros((1, width), np.int32)
        buf[0, :len(seq)] = seq
        logits = np.asarray(di.forward(params, buf))[0, len(seq) - 1]
        seq.append(int(logits.argmax()))
    return seq[len(prompt):]


@pytest.fixture(scope="module")
def ragged():
    params = golden_params("cfg_a")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (3, 40)).astype(np.int32)
    return params, tokens, np.array([40, 17, 29], np.int32)


def test_greedy_generate_equals_forward_argmax_rollout(ragged):
    params, tokens, lengths = ragged
    out = di.generate(params, tokens, lengths=lengths, max_new_tokens=10)
    for b in range(3):
        assert np.asarray(out.tokens[b]).tolist() == _argmax_rollout(params, tokens[b, :lengths[b]], 10)
    assert np.asarray(out.lengths).tolist() == [10, 10, 10]
    assert out.finish_reasons() == ["length"] * 3


def test_ragged_batch_equals_each_prompt_alone(ragged):
    params, tokens, lengths = ragged
    kw = dict(max_new_tokens=10, temperature=0.8, top_p=0.9, seed=[11, 12, 13], return_logprobs=True)
    batch = di.generate(params, tokens, lengths=lengths, **kw)
    for b in range(3):
        alone = di.generate(params, np.pad(tokens[b:b + 1, :lengths[b]], ((0, 2), (0, 40 - lengths[b]))),
                            lengths=[lengths[b], 1, 1], **{**kw, "seed": [kw["seed"][b], 0, 0]})
        np.testing.assert_array_equal(np.asarray(batch.tokens[b]), np.asarray(alone.tokens[0]))
        np.testing.assert_allclose(np.asarray(batch.logprobs[b]), np.asarray(alone.logprobs[0]), atol=1e-4)


def test_seeded_sampling_is_reproducible_and_seed_dependent(ragged):
    params, tokens, lengths = ragged
    kw = dict(lengths=lengths, max_new_tokens=10, temperature=1.0)
    a = np.asarray(di.generate(params, tokens, seed=7, **kw).tokens)
    b = np.asarray(di.generate(params, tokens, seed=7, **kw).tokens)
    c = np.asarray(di.generate(params, tokens, seed=8, **kw).tokens)
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()


def test_stop_tokens_stop_rows_independently(ragged):
    params, tokens, lengths = ragged
    free = np.asarray(di.generate(params, tokens, lengths=lengths, max_new_tokens=10).tokens)
    stop = int(free[1, 3])  # row 1 emits it at step 3 (maybe earlier too)
    out = di.generate(params, tokens, lengths=lengths, max_new_tokens=10, stop_tokens=[stop], pad_id=0)
    toks = np.asarray(out.tokens)
    for b in range(3):
        hits = np.flatnonzero(free[b] == stop)
        n = hits[0] + 1 if hits.size else 10
        assert int(out.lengths[b]) == n
        np.testing.assert_array_equal(toks[b, :n], free[b, :n])
        assert np.all(toks[b, n:] == 0)
        assert bool(out.stopped[b]) == bool(hits.size)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(tokens=[[1, 2, 300]]), ValueError, "token id 300 at row 0, position 2 is outside the vocabulary"),
    (dict(tokens=np.zeros((2, 0), np.int32)), ValueError, "empty"),
    (dict(tokens=[[1, 2]], lengths=[0]), ValueError, "empty prompt"),
    (dict(tokens=[[1, 2]], lengths=[1, 2]), ValueError, r"lengths has shape \(2,\)"),
    (dict(tokens=[[1, 2]], lengths=[3]), ValueError, "exceed the token array width"),
    (dict(tokens=[[1, 2]], max_new_tokens=1023), ValueError, "exceeds the context limit of 1024"),
    (dict(tokens=[[1.5, 2]]), TypeError, "integer"),
    (dict(tokens=[[1, 2]], max_new_tokens=0), ValueError, "max_new_tokens"),
    (dict(tokens=[[1, 2]], stop_tokens=[999]), ValueError, "stop_tokens"),
    (dict(tokens=[[1, 2]], temperature=-1.0), ValueError, "temperature"),
])
def test_bad_input_raises_clear_errors(kwargs, error, message):
    kwargs = {"max_new_tokens": 4, **kwargs}
    tokens = np.asarray(kwargs.pop("tokens"))
    with pytest.raises(error, match=message):
        di.generate(golden_params("cfg_a"), tokens, **kwargs)


def test_state_size_and_window_slots():
    cfg = di.ModelConfig.preset("tiny")
    st = init_state(cfg, 2, 128, window_slots=cfg.sliding_window + 4)
    assert st.layers[0]["window_kv"].shape == (2, cfg.sliding_window + 4, cfg.head_dim)
    assert st.layers[2]["rows"].shape == (2, 128 // cfg.hca_ratio, cfg.head_dim)
    with pytest.raises(ValueError, match="window_slots"):
        init_state(cfg, 1, 128, window_slots=cfg.sliding_window - 1)


def test_stream_generate_blocks_concatenate_to_generate(ragged):
    params, tokens, lengths = ragged
    kw = dict(lengths=lengths, max_new_tokens=10, temperature=0.7, seed=3)
    whole = np.asarray(di.generate(params, tokens, **kw).tokens)
    blocks = list(di.stream_generate(params, tokens, block=4, **kw))
    assert [b.tokens.shape[1] for b in blocks] == [4, 4, 2]
    np.testing.assert_array_equal(np.concatenate([np.asarray(b.tokens) for b in blocks], 1), whole)
    with pytest.raises(ValueError, match="stop_tokens"):
        next(di.stream_generate(params, tokens, max_new_tokens=3, stop_tokens=[-1]))
