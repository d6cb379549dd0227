"""Structured output with MTP speculative decoding (generate(constraint=..., speculative="mtp")).

* host level, no model: the masks `ConstrainedBatch.draft_step` returns at every draft slot are
  those of a fresh matcher fed the committed tokens plus the drafts so far, and after `commit`
  every row's matcher (mask, status) equals a fresh matcher fed only the committed tokens --
  with rejected drafts, accepted EOS drafts, forbidden drafts, think-then-answer rollbacks;
* generation on the random-weights model of tests/test_structured.py (same fixtures, same batch
  4 x 64 tokens, k = 3, so one constrained speculative program): every output valid; greedy
  speculative == greedy plain token for token; free rows in a mixed batch are those of an
  unconstrained speculative call; a bad constraint fails its row alone; a budget too small is
  reported; think-then-answer;
* sampled constrained speculative rows follow the plain constrained sampler's distribution
  (two-sample chi-square at several positions, many seeded rows);
* the embedded default model: valid outputs, greedy == plain greedy;
* the same with the DSpark drafter (speculative="dspark", a random drafter of block size K on the
  random-weights model): greedy == plain greedy constrained and valid, mixed batch free rows ==
  the unconstrained DSpark call, a bad constraint fails its row alone, sampled rows with the
  dynamic verify length are valid.
"""

import json
import re

import jax
import numpy as np
import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
lark = pytest.importorskip("lark")

import deepinfer_fn as di  # noqa: E402
from deepinfer_fn import structured  # noqa: E402
from deepinfer_fn.structured import (ConstrainedBatch, Grammar, JsonSchema, Matcher,  # noqa: E402
                                     Regex)
from test_speculative import two_sample_p  # noqa: E402
from test_structured import (ARITHMETIC, B, EXTRA_IDS, N, SCHEMAS, SEEDS,  # noqa: E402,F401
                             _close_expression, _texts, default_model, model, prompts, tok)
from test_structured import REGEXES as _REGEXES  # noqa: E402

K = 3
# \d -> [0-9]: Rust's \d (llguidance) knows newer Unicode digits than Python's re, and a random
# model finds them.
REGEXES = [r.replace(r"\d", "[0-9]") for r in _REGEXES]


def _spec(model, tok, prompts, constraint, temperature=0.0, **kw):
    return di.generate(model, prompts, max_new_tokens=N, constraint=constraint, tokenizer=tok,
                       temperature=temperature, seed=SEEDS, speculative="mtp",
                       num_draft_tokens=K, **kw)


def _plain(model, tok, prompts, constraint, temperature=0.0, **kw):
    return di.generate(model, prompts, max_new_tokens=N, constraint=constraint, tokenizer=tok,
                       temperature=temperature, seed=SEEDS, **kw)


def _assert_same(a, b, rows=range(B)):
    for r in rows:
        np.testing.assert_array_equal(np.asarray(a.tokens[r]), np.asarray(b.tokens[r]), f"row {r}")
        assert int(a.lengths[r]) == int(b.lengths[r]), r


def _check_bookkeeping(out):
    """Speculative steps: accepted <= verified <= K, and every row's committed tokens add up."""
    acc, ver = np.asarray(out.accepted), np.asarray(out.verified)
    assert np.all(acc <= ver) and np.all(ver <= K)
    emitted = np.where(acc >= 0, acc + 1, 0).sum(1)
    n = np.asarray(out.lengths)
    assert np.all(emitted >= np.maximum(n - 1, 0)), (emitted, n)


# ---- host level: masks at draft slots and rollback, against fresh matchers ---------------------

def _fresh_mask(constraint, tok, V, ids):
    m = Matcher(constraint, tok, V)
    assert m.consume_many(ids) == len(ids), (ids, m.error)
    return m.allowed_mask(), m.status()


def _allowed_ids(packed, V):
    return np.flatnonzero(structured.unpack_mask(packed, V))


def test_draft_masks_and_rollback_equal_fresh_matchers(tok):
    """Random verify steps on five rows (JSON, regex, grammar, think-then-answer, free): drafts
    drawn from the slot masks (now and then a forbidden draft instead), a random accepted count
    g and a correction/bonus token from m_g. Each slot mask equals a fresh matcher fed the
    committed tokens and the drafts so far; after commit, each row equals a fresh matcher fed
    only the committed tokens (mask and status), and n_keep drops the bonus after an accepted
    EOS draft."""
    V = tok.vocab_size + EXTRA_IDS
    specs = [JsonSchema(SCHEMAS[1]), Regex(REGEXES[2]), Grammar(ARITHMETIC),
             Regex(r"(yes|no|maybe)", think_first=True), None]
    R = len(specs)
    rng = np.random.default_rng(0)
    think = tok.end_of_thinking_id
    seen = dict(rejected=0, eos_draft_kept=0, forbidden=0, think_rollback=0, ended=0)
    for episode in range(6):
        batch = ConstrainedBatch.build(specs, R, tok, V)
        masks, failed = batch.initial()
        assert not failed.any()
        committed = [[] for _ in range(R)]
        active = np.ones(R, bool)
        for _step in range(14):
            if not active.any():
                break
            slot_masks, drafts = [masks], np.zeros((R, K), np.int32)
            admit = np.full(R, K)
            forbidden = np.full(R, K + 1)
            for j in range(K):
                for r in range(R):
                    ok = _allowed_ids(slot_masks[-1][r], V) if specs[r] else np.arange(V)
                    if specs[r] and rng.random() < 0.08 and len(ok) < V:  # a bad drafter
                        drafts[r, j] = rng.choice(np.setdiff1d(np.arange(V), ok))
                        forbidden[r] = min(forbidden[r], j)
                    elif specs[r] and specs[r].think_first and think in ok and rng.random() < 0.3:
                        drafts[r, j] = think
                    else:
                        drafts[r, j] = rng.choice(ok)
                m, stop = batch.draft_step(drafts[:, j], active)
                slot_masks.append(m)
                live = (forbidden > j) & (admit > j) & ~stop
                admit = np.where(stop & (admit == K), j + 1, admit)
                for r in range(R):  # slot masks are exact while the row is drafting
                    if specs[r] is None or not active[r]:
                        assert np.all(m[r] == 0xFFFFFFFF)
                    elif live[r]:
                        want, _ = _fresh_mask(specs[r], tok, V,
                                              committed[r] + drafts[r, :j + 1].tolist())
                        np.testing.assert_array_equal(m[r], want)
            # accept a random prefix of the admitted, allowed drafts, then a token from m_g
            tokens = np.zeros((R, K + 1), np.int32)
            g = np.zeros(R, np.int32)
            for r in range(R):
                g[r] = rng.integers(0, min(admit[r], forbidden[r]) + 1)
                eos_accepted = g[r] > 0 and drafts[r, g[r] - 1] == tok.eos_id
                ok = (_allowed_ids(slot_masks[g[r]][r], V) if specs[r] and not eos_accepted
                      else np.arange(V))
                tokens[r, :g[r]] = drafts[r, :g[r]]
                tokens[r, g[r]] = rng.choice(ok)
            n_emit = np.where(active, g + 1, 0)
            masks, finished, n_keep = batch.commit(tokens, g, n_emit, active)
            for r in range(R):
                if not active[r]:
                    continue
                seen["rejected"] += int(g[r] < K)
                seen["forbidden"] += int(forbidden[r] < K)
                if specs[r] is None:
                    assert n_keep[r] == n_emit[r] and not finished[r]
                    assert np.all(masks[r] == 0xFFFFFFFF)
                    continue
                kept = tokens[r, :n_keep[r]].tolist()
                if g[r] and drafts[r, g[r] - 1] == tok.eos_id:
                    assert n_keep[r] == g[r]                # the bonus after EOS is dropped
                    seen["eos_draft_kept"] += 1
                else:
                    assert n_keep[r] == n_emit[r]
                before_think = think in committed[r]
                committed[r] += kept
                want_mask, want_status = _fresh_mask(specs[r], tok, V, committed[r])
                assert batch.matchers[r].status() == want_status
                if specs[r].think_first and not before_think and think in drafts[r] \
                        and think not in committed[r]:
                    seen["think_rollback"] += 1
                if finished[r]:
                    assert committed[r][-1] == tok.eos_id and want_status == "complete"
                    active[r] = False
                    seen["ended"] += 1
                else:
                    np.testing.assert_array_equal(masks[r], want_mask)
    print(f"\nhost rollback cases: {seen}")
    assert all(v > 0 for v in seen.values()), seen


def test_draft_tokens_for_a_parallel_drafter(tok):
    """`draft_tokens` (all k drafts at once, q unmasked): the masks m_0..m_k of a row that
    drafts an answer and EOS are the fresh matcher's up to EOS, the slots after EOS are not
    admitted, and an accepted EOS drops the bonus; a forbidden first draft is not consumed (the
    masked target rejects it) and the row drafts nothing after it; free rows are all-ones."""
    V = tok.vocab_size + EXTRA_IDS
    c = Regex(r"(yes|no|maybe)")
    seq = tok.encode("yes") + [tok.eos_id]
    k = len(seq) + 1
    bad = tok.encode("x")[0]
    no = tok.encode("no")
    drafts = np.asarray([seq + [5], [bad] + no + [0] * (k - 1 - len(no)), [7] * k], np.int32)
    batch = ConstrainedBatch.build([c, c, None], 3, tok, V)
    m0, _ = batch.initial()
    masks, admit = batch.draft_tokens(drafts, np.ones(3, bool))
    assert masks.shape == (3, k + 1, structured.mask_words(V))
    assert admit.tolist() == [len(seq), k, k]
    for j in range(len(seq)):
        np.testing.assert_array_equal(masks[0, j], _fresh_mask(c, tok, V, seq[:j])[0])
    np.testing.assert_array_equal(masks[1, 0], m0[1])
    assert np.all(masks[1, 1:] == 0xFFFFFFFF) and np.all(masks[2] == 0xFFFFFFFF)
    assert np.all(masks[0, len(seq):] == 0xFFFFFFFF)
    first_no = tok.encode("no")[0]
    tokens = np.zeros((3, k + 1), np.int32)
    tokens[0, :len(seq) + 1] = seq + [9]          # all admitted drafts accepted, then a bonus
    tokens[1, 0] = first_no                       # the forbidden draft rejected: a correction
    tokens[2, :2] = [7, 3]
    g = np.asarray([len(seq), 0, 1])
    nxt, finished, n_keep = batch.commit(tokens, g, g + 1, np.ones(3, bool))
    assert n_keep.tolist() == [len(seq), 1, 2] and finished.tolist() == [True, False, False]
    assert batch.matchers[0].status() == "complete"
    np.testing.assert_array_equal(nxt[1], _fresh_mask(c, tok, V, [first_no])[0])


# ---- generation on the random-weights model ---------------------------------------------------

@pytest.fixture(scope="module")
def greedy_runs(model, tok, prompts):
    """Greedy, plain and speculative, for the four schemas, the four regexes and the grammar."""
    runs = {}
    for kind, c in [("json", [JsonSchema(s) for s in SCHEMAS]),
                    ("regex", [Regex(r) for r in REGEXES]), ("grammar", Grammar(ARITHMETIC))]:
        runs[kind] = (_plain(model, tok, prompts, c), _spec(model, tok, prompts, c))
    return runs


def _validate(kind, out, tok):
    assert out.constraint_status == ("complete",) * B, out.constraint_status
    parser = lark.Lark(ARITHMETIC, start="start")
    for b, (s, eos) in enumerate(_texts(out, tok)):
        assert eos, s
        if kind == "json":
            jsonschema.validate(json.loads(s), SCHEMAS[b])
        elif kind == "regex":
            assert re.fullmatch(REGEXES[b], s), (REGEXES[b], s)
        else:
            parser.parse(s)


@pytest.mark.parametrize("kind", ["json", "regex", "grammar"])
def test_greedy_speculative_equals_plain_and_is_valid(greedy_runs, tok, kind):
    plain, sp = greedy_runs[kind]
    _validate(kind, sp, tok)
    _assert_same(sp, plain)
    assert sp.constraint_status == plain.constraint_status
    assert sp.finish_reasons() == plain.finish_reasons()
    _check_bookkeeping(sp)


@pytest.mark.parametrize("kind", ["json", "regex", "grammar"])
def test_sampled_speculative_outputs_are_valid(model, tok, prompts, kind):
    c = {"json": [JsonSchema(s) for s in SCHEMAS], "regex": [Regex(r) for r in REGEXES],
         "grammar": Grammar(ARITHMETIC)}[kind]
    out = _spec(model, tok, prompts, c, temperature=1.0)
    _validate(kind, out, tok)
    _check_bookkeeping(out)


@pytest.mark.parametrize("method", [
    pytest.param("mtp", marks=pytest.mark.heavy),   # its own compile (~1 min on 2 cores)
    "dspark"])
def test_mixed_batch_free_rows_are_unchanged(model, tok, prompts, method, request):
    """Free rows (None) of a constrained speculative batch, greedy and sampled, are exactly what
    an unconstrained speculative call gives them (tokens, accepted / verified counts,
    logprobs); the constrained rows are valid."""
    spec_kw = (dict(speculative="mtp", num_draft_tokens=K) if method == "mtp" else
               dict(speculative="dspark", drafter=request.getfixturevalue("drafter")))
    kw = dict(temperature=[0.0, 1.0, 1.0, 0.0], return_logprobs=True, **spec_kw)
    mixed = di.generate(model, prompts, max_new_tokens=N, seed=SEEDS, tokenizer=tok,
                        constraint=[Regex(REGEXES[0]), None, JsonSchema(SCHEMAS[1]), None], **kw)
    free = di.generate(model, prompts, max_new_tokens=N, seed=SEEDS, **kw)
    assert mixed.constraint_status == ("complete", None, "complete", None)
    _assert_same(mixed, free, rows=(1, 3))
    for b in (1, 3):
        np.testing.assert_array_equal(np.asarray(mixed.accepted[b]), np.asarray(free.accepted[b]))
        np.testing.assert_array_equal(np.asarray(mixed.verified[b]), np.asarray(free.verified[b]))
        np.testing.assert_allclose(np.asarray(mixed.logprobs[b]), np.asarray(free.logprobs[b]),
                                   atol=1e-5)
    rows = _texts(mixed, tok)
    assert re.fullmatch(REGEXES[0], rows[0][0])
    jsonschema.validate(json.loads(rows[2][0]), SCHEMAS[1])


def test_invalid_constraint_fails_its_row_alone(model, tok, prompts):
    good = [Regex(REGEXES[2]), JsonSchema(SCHEMAS[2])]
    out = _spec(model, tok, prompts, [good[0], Regex("(unclosed"), Grammar("start: nope"),
                                      good[1]], temperature=1.0)
    st = out.constraint_status
    assert st[0] == st[3] == "complete"
    assert st[1].startswith("error: invalid Regex") and st[2].startswith("error: invalid Grammar")
    assert out.finish_reasons() == ["stop", "error", "error", "stop"]
    assert np.asarray(out.lengths)[[1, 2]].tolist() == [0, 0]
    assert np.all(np.asarray(out.tokens[1:3]) == model.config.eos_token_id)
    alone = _spec(model, tok, prompts, [good[0], None, None, good[1]], temperature=1.0)
    _assert_same(out, alone, rows=(0, 3))


def test_budget_too_small_is_reported(model, tok, prompts):
    out = _spec(model, tok, prompts, [Regex("[qxz~]{100}"), Regex(REGEXES[2]),
                                      Regex("[qxz~]{100}"), None], temperature=[0, 0, 1, 1])
    assert out.constraint_status == ("incomplete", "complete", "incomplete", None)
    assert out.finish_reasons()[:3] == ["length", "stop", "length"]
    for b in (0, 2):
        assert int(out.lengths[b]) == N
        assert re.fullmatch("[qxz~]{64}", _texts(out, tok)[b][0])


def test_think_then_answer(model, tok, prompts):
    """As tests/test_structured.py: free thinking, one </think>, then a constrained answer;
    the greedy rows are those of plain constrained decoding."""
    think = tok.end_of_thinking_id
    weights = dict(model.weights)
    weights["head"] = model.weights["head"].at[:, think].multiply(6.0)
    nudged = di.Params(weights, model.config)
    answer = r"(yes|no|maybe)"
    c = [Regex(answer, think_first=True), Regex(answer), JsonSchema(SCHEMAS[1], think_first=True),
         Regex(answer, think_first=True)]
    temps = [1.0, 1.0, 0.0, 0.0]
    out = _spec(nudged, tok, prompts, c, temperature=temps)
    assert out.constraint_status == ("complete",) * B, out.constraint_status
    for b in range(B):
        ids = np.asarray(out.tokens[b, :int(out.lengths[b])]).tolist()
        assert ids[-1] == tok.eos_id
        if b == 1:
            assert think not in ids
            continue
        assert ids.count(think) == 1 and tok.eos_id not in ids[:-1]
        result = tok.decode(ids[ids.index(think) + 1:-1])
        if b == 2:
            jsonschema.validate(json.loads(result), SCHEMAS[1])
        else:
            assert re.fullmatch(answer, result), result
    _assert_same(out, _plain(nudged, tok, prompts, c, temperature=temps), rows=(2, 3))


# ---- distribution: sampled constrained speculative == plain constrained sampler --------------

M = 384          # seeded rows per arm
N_DIST = 8


@pytest.mark.heavy
def test_sampled_speculative_matches_plain_constrained_distribution(model, tok, prompts):
    """Regex [a-e]{1,10}: at every position several tokens (letters and their BPE merges, and
    EOS once a letter is out) are allowed. The random model's head is scaled so the allowed
    tokens are far from uniform. Two-sample chi-square of the token at positions 1..5 (and of
    the length), speculative (k = 3) vs the plain constrained sampler with other seeds."""
    weights = dict(model.weights)
    weights["head"] = model.weights["head"] * 3.0
    peaky = di.Params(weights, model.config)
    tokens = np.repeat(prompts[:1], M, 0)
    kw = dict(max_new_tokens=N_DIST, constraint=Regex("[a-z]{1,12}"), tokenizer=tok,
              temperature=1.0)
    seeds = np.arange(M)
    plain = di.generate(peaky, tokens, seed=seeds + 50_000, **kw)
    sp = di.generate(peaky, tokens, seed=seeds, speculative="mtp", num_draft_tokens=K, **kw)
    assert set(sp.constraint_status) <= {"complete", "incomplete"}
    for s, _ in _texts(sp, tok)[:B]:
        assert re.fullmatch("[a-z]{0,12}", s), s
    a, p = np.asarray(sp.tokens), np.asarray(plain.tokens)
    acc = sp.acceptance()
    ps = [two_sample_p(a[:, t], p[:, t]) for t in range(1, 6)]
    ps.append(two_sample_p(np.asarray(sp.lengths), np.asarray(plain.lengths), min_count=5))
    distinct = [len(np.unique(p[:, t])) for t in range(1, 6)]
    print(f"\nconstrained sampled k={K}: acceptance {acc}, distinct tokens {distinct}, "
          f"p-values {np.round(ps, 3).tolist()}")
    assert min(distinct) >= 20                # the test has something to compare
    assert acc["mean_accepted"] > 0.1 and acc["acceptance_rate"] < 0.95  # accept + residual
    assert min(ps) > 0.01
    # Power: the same sample size tells the plain sampler at temperature 1.5 apart.
    hot = np.asarray(di.generate(peaky, tokens, seed=seeds + 90_000,
                                 **dict(kw, temperature=1.5)).tokens)
    p_hot = [two_sample_p(a[:, t], hot[:, t]) for t in range(1, 6)]
    print(f"power check (plain at T=1.5): p-values {np.round(p_hot, 5).tolist()}")
    assert min(p_hot) < 1e-3


# ---- the embedded default model -------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.0, pytest.param(0.8, marks=pytest.mark.heavy)],
                         ids=["greedy", "sampled"])
def test_default_model_outputs_are_valid(default_model, temperature):
    """JSON schemas, regexes and the arithmetic grammar with speculative decoding on the
    trained default model (its MTP drafts accept often); greedy == plain greedy."""
    params, dtok = default_model
    tokens = np.asarray([dtok.encode("def parse(value):\n    return ")] * B, np.int32)
    parser = lark.Lark(ARITHMETIC, start="start")
    for kind, c in [("json", [JsonSchema(s) for s in SCHEMAS]),
                    ("regex", [Regex(r) for r in REGEXES]), ("grammar", Grammar(ARITHMETIC))]:
        kw = dict(max_new_tokens=N, constraint=c, tokenizer=dtok, temperature=temperature,
                  seed=SEEDS)
        out = di.generate(params, tokens, speculative="mtp", num_draft_tokens=K, **kw)
        _check_bookkeeping(out)
        status = out.constraint_status
        if kind == "grammar":
            assert set(status) <= {"complete", "incomplete"}, status
        else:
            assert status == ("complete",) * B, status
        for b, (s, eos) in enumerate(_texts(out, dtok)):
            if kind == "json":
                assert eos
                jsonschema.validate(json.loads(s), SCHEMAS[b])
            elif kind == "regex":
                assert re.fullmatch(REGEXES[b], s), (REGEXES[b], s)
            elif status[b] == "complete":
                parser.parse(s)
            else:
                parser.parse(_close_expression(s))
        if temperature == 0.0:
            plain = di.generate(params, tokens, **kw)
            _assert_same(out, plain)
            assert out.constraint_status == plain.constraint_status
        print(f"\ndefault model {kind} T={temperature}: acceptance {out.acceptance()}")


# ---- DSpark drafter (speculative="dspark") on the random-weights model ---------------------------

@pytest.fixture(scope="module")
def drafter(model):
    from deepinfer_fn.speculative import dspark
    dcfg = dspark.DSparkConfig.for_target(model.config, block_size=K, markov_rank=32,
                                          target_layer_ids=(1, 3), noise_token_id=2)
    return dspark.init_dspark(model.config, dcfg, jax.random.key(5))


def _dspark(model, tok, prompts, constraint, drafter, temperature=0.0, **kw):
    return di.generate(model, prompts, max_new_tokens=N, constraint=constraint, tokenizer=tok,
                       temperature=temperature, seed=SEEDS, speculative="dspark",
                       drafter=drafter, **kw)


@pytest.fixture(scope="module")
def dspark_greedy_runs(model, tok, prompts, drafter):
    runs = {}
    for kind, c in [("json", [JsonSchema(s) for s in SCHEMAS]),
                    ("regex", [Regex(r) for r in REGEXES]), ("grammar", Grammar(ARITHMETIC))]:
        runs[kind] = (_plain(model, tok, prompts, c), _dspark(model, tok, prompts, c, drafter))
    return runs


@pytest.mark.parametrize("kind", ["json", "regex", "grammar"])
def test_dspark_greedy_equals_plain_and_is_valid(dspark_greedy_runs, tok, kind):
    plain, sp = dspark_greedy_runs[kind]
    _validate(kind, sp, tok)
    _assert_same(sp, plain)
    assert sp.constraint_status == plain.constraint_status
    assert sp.finish_reasons() == plain.finish_reasons()
    _check_bookkeeping(sp)
    assert np.asarray(sp.accepted).max() > 0   # grammar-forced drafts do get accepted


def test_dspark_invalid_constraint_fails_its_row_alone(model, tok, prompts, drafter):
    good = [Regex(REGEXES[2]), JsonSchema(SCHEMAS[2])]
    out = _dspark(model, tok, prompts, [good[0], Regex("(unclosed"), Grammar("start: nope"),
                                        good[1]], drafter, temperature=1.0)
    st = out.constraint_status
    assert st[0] == st[3] == "complete"
    assert st[1].startswith("error: invalid Regex") and st[2].startswith("error: invalid Grammar")
    assert out.finish_reasons() == ["stop", "error", "error", "stop"]
    assert np.asarray(out.lengths)[[1, 2]].tolist() == [0, 0]
    assert np.all(np.asarray(out.tokens[1:3]) == model.config.eos_token_id)
    alone = _dspark(model, tok, prompts, [good[0], None, None, good[1]], drafter, temperature=1.0)
    _assert_same(out, alone, rows=(0, 3))


@pytest.mark.parametrize("kind", ["json", pytest.param("grammar", marks=pytest.mark.heavy)])
def test_dspark_sampled_dynamic_verify_length_is_valid(model, tok, prompts, drafter, kind):
    """Sampled rows with the dynamic verify length (a cost that grows with the columns, so
    ell varies): valid outputs, and ell never passes the grammar-admitted slots."""
    from deepinfer_fn.speculative import schedule
    cost = schedule.VerifyCost.from_grid((B,), np.asarray([[1.0, 1.3, 1.7, 2.2]]))
    c = {"json": [JsonSchema(s) for s in SCHEMAS], "grammar": Grammar(ARITHMETIC)}[kind]
    out = _dspark(model, tok, prompts, c, drafter, temperature=1.0, verify_len="dynamic",
                  verify_cost=cost)
    _validate(kind, out, tok)
    _check_bookkeeping(out)


def test_dspark_stream_generate_constrained(dspark_greedy_runs, model, tok, prompts, drafter):
    """stream_generate(..., constraint=, speculative="dspark"): the pieces add up to
    generate's constrained DSpark tokens (the matchers wait with their rows between pieces);
    running rows are "pending" until the last piece, which has generate's statuses."""
    _, whole = dspark_greedy_runs["regex"]
    pieces = list(di.stream_generate(model, prompts, block=8, max_new_tokens=N,
                                     constraint=[Regex(r) for r in REGEXES], tokenizer=tok,
                                     temperature=0.0, seed=SEEDS, speculative="dspark",
                                     drafter=drafter))
    assert len(pieces) >= 2
    n = np.asarray(whole.lengths)
    for b in range(len(n)):
        ids = np.concatenate([np.asarray(p.tokens[b, :int(p.lengths[b])]) for p in pieces])
        np.testing.assert_array_equal(ids, np.asarray(whole.tokens)[b, :n[b]])
    assert pieces[-1].constraint_status == whole.constraint_status
    first = pieces[0]
    for b, st in enumerate(first.constraint_status):
        assert st == ("pending" if int(first.lengths[b]) < n[b] else whole.constraint_status[b])


@pytest.mark.heavy
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
def test_constrained_on_a_sharded_mesh(dspark_greedy_runs, model, tok, prompts, drafter):
    """Structured output on dp=2,ep=4 (4 rows padded to 8; the host matchers see the padding
    rows as free): plain and DSpark constrained decoding give the single-device tokens and
    statuses."""
    import shardings
    from conftest import no_cache_writes
    plain, sp = dspark_greedy_runs["regex"]
    mesh_params = shardings.shard_params(model, shardings.make_mesh(dp=2, ep=4))
    c = [Regex(r) for r in REGEXES]
    with no_cache_writes():
        for want, got in [(plain, _plain(mesh_params, tok, prompts, c)),
                          (sp, _dspark(mesh_params, tok, prompts, c, drafter))]:
            _assert_same(got, want)
            assert got.constraint_status == want.constraint_status
