"""Structured output in the offline engine (Request(constraint=...)).

Oracle: `di.generate(..., constraint=[...])` (the non-engine constrained decode loop) on the
embedded default model in f32 with its own tokenizer (Engine(tokenizer=...)); greedy, so the engine must give the
same tokens per request. Also: outputs valid (regex fullmatch, jsonschema), free requests next to
constrained ones unchanged (vs an engine run with the free requests alone), a bad grammar failing
alone, and "incomplete" when max_new_tokens is too small. Shapes as tests/test_engine.py.
"""

import functools
import json
import re

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

import deepinfer_fn as di  # noqa: E402
from deepinfer_fn import text  # noqa: E402
from deepinfer_fn.engine import Engine, Request  # noqa: E402

N = 24
SHAPES = dict(max_batch=4, page_size=16, max_len=320, num_pages=24,
              prefill_shapes=((2, 32),), decode_buckets=(4,), progress=False)
PATTERN = r"(cat|dog|bird)s? (run|sleep)"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                          "tag": {"type": "string", "maxLength": 6}},
          "required": ["ok", "tag"], "additionalProperties": False}
CONSTRAINTS = (di.Regex(PATTERN), di.JsonSchema(SCHEMA), None, di.Regex(r"[0-9]{2}-[a-z]{2,4}"))


@functools.cache
def params():
    return di.load_params(di.default_model_path(), dtype=jnp.float32)


@functools.cache
def tokenizer():
    return text.load_tokenizer(di.default_model_path())


@functools.cache
def prompts():
    rng = np.random.default_rng(7)
    return tuple(tuple(rng.integers(2, 4096, n).tolist()) for n in (20, 37, 12, 45))


@functools.cache
def reference():
    """generate() with one constraint per row (None: free), greedy."""
    ps = prompts()
    toks = np.zeros((len(ps), 64), np.int32)
    for i, p in enumerate(ps):
        toks[i, :len(p)] = p
    out = di.generate(params(), toks, lengths=np.array([len(p) for p in ps]), max_new_tokens=N,
                      constraint=list(CONSTRAINTS), tokenizer=tokenizer())
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    return [tokens[b, :lengths[b]].tolist() for b in range(len(ps))], out.constraint_status


@functools.cache
def engine():
    return Engine(params(), tokenizer=tokenizer(), **SHAPES)


def _requests(max_new=N):
    return [Request(p, max_new_tokens=max_new, constraint=c, request_id=i)
            for i, (p, c) in enumerate(zip(prompts(), CONSTRAINTS))]


def _text(tokens):
    tok = tokenizer()
    return tok.decode([t for t in tokens if t != tok.eos_id])


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_engine_constrained_matches_generate_and_is_valid(async_scheduling):
    ref_tokens, ref_status = reference()
    eng = engine()
    eng.async_scheduling = async_scheduling
    try:
        outs = eng.generate(_requests())
    finally:
        eng.async_scheduling = True
    eos = tokenizer().eos_id
    for out, ref, st, c in zip(outs, ref_tokens, ref_status, CONSTRAINTS):
        assert out.tokens == ref, (out.request_id, out.tokens, ref)
        assert out.constraint_status == st
        if c is None:
            continue
        if st == "complete":
            assert out.tokens[-1] == eos and out.finish_reason == "stop"
            txt = _text(out.tokens)
            if isinstance(c, di.Regex):
                assert re.fullmatch(c.pattern, txt), txt
            else:
                jsonschema.validate(json.loads(txt), SCHEMA)
        else:
            assert out.finish_reason == "length" and len(out.tokens) == N
    # short, closed constraints: greedy completes them well within N tokens
    assert [o.constraint_status for o in outs] == ["complete", "complete", None, "complete"]


def test_free_requests_unchanged_by_constrained_neighbours():
    eng = engine()
    free = [Request(p, max_new_tokens=N, request_id=i) for i, p in enumerate(prompts())]
    alone = eng.generate(free)
    mixed = eng.generate(_requests())
    assert mixed[2].tokens == alone[2].tokens and mixed[2].constraint_status is None
    assert mixed[0].tokens != alone[0].tokens       # the constraint did change that request


def test_bad_grammar_fails_alone_and_incomplete_is_reported():
    eng = engine()
    ref_tokens, _ = reference()
    reqs = _requests()
    reqs[2] = Request(prompts()[2], max_new_tokens=N, constraint=di.Regex("(ab"), request_id="bad")
    reqs.append(Request(prompts()[1], max_new_tokens=3, constraint=di.JsonSchema(SCHEMA),
                        request_id="short"))
    reqs.append(Request(prompts()[0], max_new_tokens=N,
                        constraint=di.Grammar("start: ( "), request_id="bad_lark"))
    outs = eng.generate(reqs)
    for i in (0, 1, 3):
        assert outs[i].tokens == ref_tokens[i]
    for o in (outs[2], outs[5]):
        assert o.finish_reason == "error" and o.constraint_status == "error" and o.tokens == []
        assert o.error and o.error.startswith("constraint:"), o.error
    short = outs[4]
    assert short.finish_reason == "length" and short.constraint_status == "incomplete"
    assert short.tokens == ref_tokens[1][:3]
    assert _text(short.tokens).startswith("{")


def test_sampled_constrained_equals_generate_with_same_seed():
    """temperature 0.8, per-request seeds: the engine's masked draws use generate()'s keys."""
    ps = prompts()
    temps, seeds = np.array([0.8, 0.8, 0.8, 0.8], np.float32), np.array([3, 5, 7, 11])
    toks = np.zeros((len(ps), 64), np.int32)
    for i, p in enumerate(ps):
        toks[i, :len(p)] = p
    ref = di.generate(params(), toks, lengths=np.array([len(p) for p in ps]), max_new_tokens=N,
                      constraint=list(CONSTRAINTS), tokenizer=tokenizer(), temperature=temps,
                      seed=seeds)
    lengths = np.asarray(ref.lengths)
    reqs = [Request(p, max_new_tokens=N, constraint=c, temperature=0.8, seed=int(s))
            for p, c, s in zip(ps, CONSTRAINTS, seeds)]
    outs = engine().generate(reqs)
    for b, out in enumerate(outs):
        assert out.tokens == np.asarray(ref.tokens)[b, :lengths[b]].tolist(), b
        assert out.constraint_status == ref.constraint_status[b]
    assert outs[0].constraint_status == "complete"
    assert re.fullmatch(PATTERN, _text(outs[0].tokens))


def test_constrained_requests_survive_preemption():
    """6 prompts of 50-110 tokens (4 at once need more than the 23 usable pages): preempted
    constrained requests resume with their matchers intact (same tokens as generate)."""
    rng = np.random.default_rng(1)
    ps = [rng.integers(2, 4096, n).tolist() for n in (95, 50, 110, 72, 101, 64)]
    cons = [CONSTRAINTS[0], None, CONSTRAINTS[1], CONSTRAINTS[3], CONSTRAINTS[1], None]
    toks = np.zeros((len(ps), 128), np.int32)
    for i, p in enumerate(ps):
        toks[i, :len(p)] = p
    ref = di.generate(params(), toks, lengths=np.array([len(p) for p in ps]), max_new_tokens=N,
                      constraint=cons, tokenizer=tokenizer())
    eng = engine()
    outs = eng.generate([Request(p, max_new_tokens=N, constraint=c) for p, c in zip(ps, cons)])
    assert eng.last_run.preemptions > 0
    lengths = np.asarray(ref.lengths)
    for b, out in enumerate(outs):
        assert out.tokens == np.asarray(ref.tokens)[b, :lengths[b]].tolist(), b
        assert out.constraint_status == ref.constraint_status[b]
