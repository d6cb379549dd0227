"""The loop prefill of short prompts: generate feeds prompts of at most
`LOOP_PREFILL_MAX_TOKENS` tokens through its decode loop (`decode_block(prompt=)`) and
compiles no prefill program; its tokens, logprobs, stops and streams equal those of the
chunked prefill (DEEPINFER_LOOP_PREFILL=off)."""

import importlib

import jax
import numpy as np
import pytest

import deepinfer_fn as di
from deepinfer_fn.compile_cache import ProgramCounter
from deepinfer_fn.decoding import plain

gen = importlib.import_module("deepinfer_fn.generate")

# ragged: rows of 9, 3 and 16 real tokens (16 = the loop prefill's widest prompt)
LENGTHS = np.array([9, 3, 16])


@pytest.fixture(scope="module")
def model():
    cfg = di.ModelConfig.preset("tiny", max_position_embeddings=256)
    params = di.init_params(cfg, jax.random.key(3))
    rng = np.random.default_rng(5)
    tokens = rng.integers(2, cfg.vocab_size, (3, 16)).astype(np.int32)
    for b, n in enumerate(LENGTHS):
        tokens[b, n:] = 0
    return params, tokens


def _chunked(monkeypatch, fn, *args, **kwargs):
    with monkeypatch.context() as m:
        m.setenv("DEEPINFER_LOOP_PREFILL", "off")
        return fn(*args, **kwargs)


@pytest.mark.parametrize("sampling", [dict(temperature=0.0),
                                      dict(temperature=0.9, top_p=0.9, seed=[4, 5, 6])])
def test_loop_prefill_equals_chunked_prefill(model, monkeypatch, sampling):
    params, tokens = model
    with ProgramCounter() as counter:
        loop = di.generate(params, tokens, lengths=LENGTHS, max_new_tokens=11,
                           return_logprobs=True, **sampling)
    assert not any("prefill" in name for name in counter.names), counter.names
    ref = _chunked(monkeypatch, di.generate, params, tokens, lengths=LENGTHS, max_new_tokens=11,
                   return_logprobs=True, **sampling)
    np.testing.assert_array_equal(loop.tokens, ref.tokens)
    np.testing.assert_array_equal(loop.lengths, ref.lengths)
    np.testing.assert_allclose(loop.logprobs, ref.logprobs, atol=1e-5)


def test_loop_prefill_stops_rows_independently(model, monkeypatch):
    params, tokens = model
    free = di.generate(params, tokens, lengths=LENGTHS, max_new_tokens=10)
    stop = int(free.tokens[1, 2])              # row 1 stops after its third token
    loop = di.generate(params, tokens, lengths=LENGTHS, max_new_tokens=10, stop_tokens=[stop],
                       pad_id=1)
    ref = _chunked(monkeypatch, di.generate, params, tokens, lengths=LENGTHS,
                   max_new_tokens=10, stop_tokens=[stop], pad_id=1)
    np.testing.assert_array_equal(loop.tokens, ref.tokens)
    np.testing.assert_array_equal(loop.lengths, ref.lengths)
    assert loop.lengths[1] <= 3 and np.all(loop.tokens[1, loop.lengths[1]:] == 1)


def test_loop_prefill_streams_like_chunked_prefill(model, monkeypatch):
    """Blocks after the first feed no prompt (lengths 0) through the same program; rows that
    ended their block early keep their logits for the next one."""
    params, tokens = model
    kwargs = dict(lengths=LENGTHS, max_new_tokens=10, block=4, temperature=0.7, seed=2)
    with ProgramCounter() as counter:
        loop = [o.tokens for o in di.stream_generate(params, tokens, **kwargs)]
    assert not any("prefill" in name for name in counter.names), counter.names
    ref = _chunked(monkeypatch, lambda: [o.tokens for o in di.stream_generate(params, tokens,
                                                                              **kwargs)])
    assert [t.shape for t in loop] == [(3, 4), (3, 4), (3, 2)]
    np.testing.assert_array_equal(np.concatenate(loop, 1), np.concatenate(ref, 1))
    whole = di.generate(params, tokens, lengths=LENGTHS, max_new_tokens=10, temperature=0.7,
                        seed=2)
    np.testing.assert_array_equal(np.concatenate(loop, 1), whole.tokens)


def test_which_calls_use_the_loop_prefill(monkeypatch):
    assert plain.uses_loop_prefill(plain.LOOP_PREFILL_MAX_TOKENS)
    assert not plain.uses_loop_prefill(plain.LOOP_PREFILL_MAX_TOKENS + 1)
    assert not plain.uses_loop_prefill(4, sharded=True)
    assert not plain.uses_loop_prefill(4, constrained=True)
    assert not plain.uses_loop_prefill(4, bounded_replay=True)
    monkeypatch.setenv("DEEPINFER_LOOP_PREFILL", "off")
    assert not plain.uses_loop_prefill(4)


def test_generate_programs_has_no_prefill_for_short_prompts(model):
    params, _ = model
    fns = lambda T: [job.fn for job in gen.generate_programs(params, 2, T, 8)]
    assert fns(plain.LOOP_PREFILL_MAX_TOKENS) == [gen.empty_state, gen.decode_block]
    assert fns(plain.LOOP_PREFILL_MAX_TOKENS + 1) == [gen.empty_state, gen.prefill_forward,
                                                      gen.decode_block]


def test_loop_prompt_rejects_long_prompts():
    with pytest.raises(AssertionError):
        plain.loop_prompt(np.zeros((1, plain.LOOP_PREFILL_MAX_TOKENS + 1), np.int32),
                          np.ones((1,), np.int32))


def test_benchmark_compares_both_arms_on_the_same_call():
    from benchmarks import loop_prefill
    result = loop_prefill.main(["--models", "tiny", "--batches", "2", "--prompt-len", "5",
                                "--new-tokens", "4", "--reps", "1", "--dtype", "float32"])
    loop, chunked = result["rows"]["tiny"]
    assert (loop["arm"], chunked["arm"]) == ("loop", "chunked")
    assert not any("prefill" in name for name in loop["programs"]), loop["programs"]
    assert any("prefill_forward" in name for name in chunked["programs"]), chunked["programs"]
    assert loop["tokens"] == chunked["tokens"]
    assert loop["same_tokens_as_first"] and chunked["same_tokens_as_first"]
