"""Structured output never emits a token its grammar refuses (host side, no model): the mask a
row is sampled under is exactly what `Matcher.consume` accepts (brute force over the vocabulary
on random walks through several grammars), a mask llguidance cannot compute ends the row with a
clear status, and a token sampled outside its mask is reported as such.

The real-world repro (tests/data/structured_marathon_lb_schema.json, seed 15 of the embedded
default model): the matcher's masks were right all along -- replaying the sampled tokens shows
the 112th, "pid" (3018), was never allowed. The sampler drew it because its Gumbel noise was
+inf there (u = 1 after float32 rounding), and -inf (masked) + inf = nan wins the argmax; the
sampler test below pins that key.
"""

import json
import pathlib
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("llguidance")

import deepinfer_fn as di  # noqa: E402
from deepinfer_fn import sampling, structured, text  # noqa: E402
from deepinfer_fn.structured import ConstrainedBatch, Grammar, JsonSchema, Matcher, Regex  # noqa: E402

DATA = pathlib.Path(__file__).parent / "data"
EXTRA_IDS = 16  # model ids past the tokenizer's vocabulary: never allowed

# The repro's sampled tokens (default model, float32, prompt "Answer in JSON:", temperature 1,
# seed 15): a long JSON number, then "pid" (3018), which the schema cannot take there.
REPRO_TOKENS = [
    111, 307, 46, 2323, 43, 1631, 38, 34, 42, 42, 41, 44, 44, 2858, 622, 3825, 2690, 45, 45, 44,
    2578, 39, 40, 42, 45, 39, 39, 1591, 1209, 40, 44, 45, 968, 43, 45, 1631, 41, 1007, 39, 40, 37,
    2413, 39, 40, 44, 45, 1007, 43, 36, 42, 1918, 42, 39, 1007, 36, 44, 44, 40, 44, 42, 45, 38, 943,
    45, 42, 2690, 39, 39, 40, 44, 37, 39, 45, 40, 44, 42, 45, 44, 41, 45, 40, 44, 36, 41, 39, 40, 38,
    40, 40, 1492, 36, 40, 37, 41, 1866, 39, 40, 40, 45, 40, 44, 44, 37, 43, 36, 1180, 89, 45, 43, 40,
    39, 3018]
REPRO_SEED, REPRO_POSITION, REPRO_TOKEN = 15, 118, 3018  # position = 6 prompt tokens + 112

ARITHMETIC = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,4}(\.[0-9]{1,2})?/
"""

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]},
                                  "maxItems": 3},
                         "ok": {"type": "boolean"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    try:
        path = di.default_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"no embedded default model tokenizer: {e}")
    return text.load_tokenizer(path)


@pytest.fixture(scope="module")
def small_tok(tmp_path_factory):
    """A byte-level BPE of 333 ids (not a multiple of 32: the last mask word is partial) with
    the V4 chat special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    rng = random.Random(0)
    corpus = [json.dumps({"name": rng.choice(["ab", "cd", "marathon"]), "age": rng.randint(0, 200),
                          "tags": ["a", "bb"][:rng.randint(0, 2)]}) for _ in range(200)]
    corpus += [f"({rng.randint(0, 99)}+{rng.randint(0, 999)})*{rng.random():.2f}"
               for _ in range(200)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=333, special_tokens=text.chat_special_tokens(),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(corpus, trainer)
    directory = tmp_path_factory.mktemp("bpe")
    bpe.save(str(directory / "tokenizer.json"))
    small = text.load_tokenizer(directory)
    assert small.vocab_size % 32
    return small


@pytest.fixture(scope="module")
def marathon_lb():
    return json.loads((DATA / "structured_marathon_lb_schema.json").read_text())


def _bits(m: Matcher) -> np.ndarray:
    return structured.unpack_mask(m.allowed_mask(), m.vocab_size)


# ---- the repro ------------------------------------------------------------------------------

def test_repro_tokens_replay_exactly_under_the_masks(tok, marathon_lb):
    """Every sampled token of the failing row was allowed by the mask of its step and consumed;
    "pid" was not allowed at its step, and consume refuses it: mask and consume agree."""
    m = Matcher(JsonSchema(marathon_lb), tok, tok.vocab_size)
    assert m.error is None and m.approximations == ()
    for i, t in enumerate(REPRO_TOKENS[:-1]):
        assert _bits(m)[t], (i, t)
        assert m.consume(t), (i, m.error)
    mask = _bits(m)
    assert not mask[REPRO_TOKEN] and mask.sum() > 0
    assert set(tok.decode([int(v)]) for v in np.flatnonzero(mask)) <= (
        set("0123456789,}") | {tok.decode([int(v)]) for v in np.flatnonzero(mask)
                               if tok.decode([int(v)]).isdigit()})
    assert not m.consume(REPRO_TOKEN) and "does not satisfy the constraint" in m.error


def test_sampler_never_draws_a_masked_token_at_the_repro_key():
    """At the repro's (seed, position) the noise of token 3018 sits on the top uniform value:
    finite now, and neither a mask nor top-k lets it through."""
    V = 4096
    keys = sampling.request_key(jnp.asarray([REPRO_SEED], jnp.uint32),
                                jnp.asarray([REPRO_POSITION], jnp.int32), role=sampling.Role.GUMBEL)
    noise = np.asarray(jax.jit(sampling.gumbel_noise, static_argnums=1)(keys, V))[0]
    assert np.isfinite(noise).all()
    assert noise.argmax() == REPRO_TOKEN  # the saturated draw: the clamp is what is tested
    sp = sampling.sampling_params(1, temperature=1.0, seed=[REPRO_SEED])
    logits = jnp.zeros((1, V), jnp.float32)
    allowed = jnp.ones((1, V), bool).at[0, REPRO_TOKEN].set(False)
    pos = jnp.asarray([REPRO_POSITION], jnp.int32)
    token, lp = jax.jit(sampling.sample)(logits, sp, pos, allowed)
    assert int(token[0]) != REPRO_TOKEN and np.isfinite(float(lp[0]))
    topk = sampling.sampling_params(1, temperature=1.0, top_k=1, seed=[REPRO_SEED])
    token, _ = jax.jit(sampling.sample)(logits.at[0, 7].set(5.0), topk, pos)
    assert int(token[0]) == 7


# ---- masks == consume, brute force ------------------------------------------------------------

def _expected(m: Matcher, lt, v: int) -> bool:
    """What consume(v) would do, from llguidance's token check (no commit) and the Matcher's
    rules for EOS, special tokens and ids past the tokenizer (module docstring of structured)."""
    if m.is_finished() or v >= m._tok_vocab:
        return False
    if m.thinking:
        return v != m.eos_id
    if v == m.eos_id:
        return m.is_accepting()
    if lt.is_special_token(v):
        return False
    return m._ll.validate_tokens([v]) == 1


def _check_state(m: Matcher, lt, rng: random.Random) -> np.ndarray:
    """Asserts that every token the mask allows is consumable, over the whole model vocabulary
    (`consume` itself, on copies, for a sample of them), and that EOS, the special tokens and
    ids past the tokenizer are allowed exactly when consume takes them. The mask may refuse a
    consumable token: where the grammar forces bytes, llguidance allows only their canonical
    tokens (after '{"' of a fixed first key, "name" but not "n")."""
    mask = _bits(m)
    assert m.error is None, m.error
    expected = np.array([_expected(m, lt, v) for v in range(m.vocab_size)])
    assert not (mask & ~expected).any(), np.flatnonzero(mask & ~expected)[:10]
    assert mask.any()
    assert mask.sum() >= 0.5 * expected.sum() or expected.sum() < 16, (mask.sum(), expected.sum())
    special = [v for v in range(m._tok_vocab) if lt.is_special_token(v)]
    allowed = np.flatnonzero(mask).tolist()
    for v in rng.sample(allowed, min(48, len(allowed))):
        c = m.copy()
        assert c.consume(v), (v, c.error)
    for v in special + list(range(m._tok_vocab, m.vocab_size)):
        c = m.copy()
        assert c.consume(v) == bool(mask[v]) == _expected(m, lt, v), (v, c.error)
    return mask


CONSTRAINTS = {
    "person": JsonSchema(PERSON),
    "marathon_lb": None,  # the repro schema (fixture)
    "regex": Regex(r"[a-z]{2,6}-[0-9]{1,3}(\.[0-9]+)?"),
    "arithmetic": Grammar(ARITHMETIC),
    "think_then_json": JsonSchema({"type": "array", "items": {"type": "integer"}, "maxItems": 4},
                                  think_first=True),
}


@pytest.mark.parametrize("vocab", ["default", "small"])
@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_every_allowed_token_is_consumed_on_random_walks(tok, small_tok, marathon_lb, name, vocab):
    """Random walks (each step a random allowed token; an EOS ends the walk): at every few
    states, every token the mask allows is consumed, over the whole model vocabulary (the
    embedded model's tokenizer and a small one whose size is not a multiple of 32)."""
    constraint = CONSTRAINTS[name] or JsonSchema(marathon_lb)
    tok = tok if vocab == "default" else small_tok
    lt = structured.ll_tokenizer(tok)
    rng = random.Random(name)
    for walk in range(3):
        m = Matcher(constraint, tok, tok.vocab_size + EXTRA_IDS)
        assert m.error is None, m.error
        for step in range(40):
            if step % 7 == walk:
                mask = _check_state(m, lt, rng)
            else:
                mask = _bits(m)
            allowed = np.flatnonzero(mask)
            if m.thinking and step > 3 and rng.random() < 0.5:
                t = tok.end_of_thinking_id
            else:
                t = int(rng.choice(allowed.tolist()))
            assert m.consume(t), (step, t, m.error)
            if m.is_finished():
                assert t == tok.eos_id and m.status() == "complete"
                break


# ---- a mask llguidance cannot compute ends the row ---------------------------------------------

def test_mask_failure_ends_the_row_with_a_clear_status(tok):
    """A lexer limit hit while computing a mask: the mask is all-zero (never permissive), the
    row finishes with "error: grammar engine could not compute a mask: ...", alone in its batch
    (the batched llguidance call included)."""
    schema = JsonSchema({"type": "object", "properties": {"a": {"type": "string"}}})
    for rows in (1, 3):
        matchers = [Matcher(schema, tok, tok.vocab_size, limits={"step_lexer_fuel": 10})]
        matchers += [Matcher(schema, tok, tok.vocab_size) for _ in range(rows - 1)]
        batch = ConstrainedBatch(matchers, tok.vocab_size)
        masks, finished = batch.initial()
        assert not finished.any()
        first = tok.encode("{")[0]
        masks, finished = batch.step(np.full((rows,), first), np.ones((rows,), bool))
        assert finished.tolist() == [True] + [False] * (rows - 1)
        status = batch.statuses()[0]
        assert status.startswith(f"error: {structured.MASK_FAILED}: "), status
        assert all(s == "incomplete" for s in batch.statuses()[1:])
        assert (structured.unpack_mask(masks[1:], tok.vocab_size).sum(-1) > 0).all()
        out = np.full((structured.mask_words(tok.vocab_size),), 7, np.uint32)
        matchers[0].fill_mask(out)
        assert not out.any()


def test_fill_masks_equals_each_matchers_own_mask(tok, small_tok):
    """The batched mask fill (one parallel llguidance call for the grammar rows) writes, into
    the rows given, exactly what each matcher computes alone; a thinking row, a finished row,
    a matcher of another tokenizer and a failing one are mixed in."""
    think = JsonSchema({"type": "integer"}, think_first=True)
    specs = [JsonSchema(PERSON), Regex(r"[0-9]{2,4}"), Grammar(ARITHMETIC), think, Regex("ab")]
    V = tok.vocab_size + EXTRA_IDS
    matchers = [Matcher(c, tok, V) for c in specs]
    fuel = JsonSchema({"type": "object", "properties": {"a": {"type": "string"}}})
    matchers.append(Matcher(fuel, tok, V, limits={"step_lexer_fuel": 10}))
    assert matchers[4].consume_many(tok.encode("ab")) == len(tok.encode("ab"))
    assert matchers[4].consume(tok.eos_id) and matchers[4].is_finished()
    assert matchers[5].consume(tok.encode("{")[0])
    other = Matcher(Regex(r"[0-9]+"), small_tok, V)   # another tokenizer: filled on its own
    for m in matchers[:3]:
        assert m.consume(int(np.flatnonzero(_bits(m))[0]))
    rows = [7, 0, 3, 5, 1, 2, 4]
    for group in (matchers, matchers + [other]):    # one parallel call; per row (2 tokenizers)
        group = [m.copy() for m in group]
        alone = [m.copy() for m in group]
        want = [a.allowed_mask() for a in alone]
        out = np.full((8, structured.mask_words(V)), 7, np.uint32)
        structured.fill_masks(group, out, rows[:len(group)])
        for k, r in enumerate(rows[:len(group)]):
            np.testing.assert_array_equal(out[r], want[k], err_msg=f"matcher {k}")
            assert group[k].status() == alone[k].status()
        assert (out[6] == 7).all()                      # rows not named are left alone
    structured.fill_masks(matchers, np.zeros((8, structured.mask_words(V)), np.uint32), rows[:6])
    assert matchers[5].status().startswith(f"error: {structured.MASK_FAILED}")
    assert _bits(matchers[3]).sum() == tok.vocab_size - 1    # thinking: all but EOS
    with pytest.raises(ValueError, match="2 matchers for 1 rows"):
        structured.fill_masks(matchers[:2], out, [0])


def test_host_failure_ends_live_rows_only(tok):
    """A host callback that fails mid-step ends every live constrained row with the failure's
    message and all-ones masks; free and already finished rows stay as they were."""
    seven = tok.encode("7")[0]
    batch = ConstrainedBatch.build([Regex("[0-9]+"), None, Regex("[0-9]")], 3, tok,
                                   tok.vocab_size)
    batch.initial()
    batch.step(np.asarray([seven, 5, seven]), np.ones((3,), bool))
    _, finished = batch.step(np.asarray([seven, 5, tok.eos_id]), np.ones((3,), bool))
    assert finished.tolist() == [False, False, True]
    sid = structured.register(batch)
    try:   # no tokens for the batch: the step raises before consuming anything
        masks, finished = structured.host_step(sid, np.zeros((0,), np.int32), np.ones((3,), bool))
    finally:
        structured.unregister(sid)
    assert (masks == 0xFFFFFFFF).all() and finished.tolist() == [True, False, False]
    status = batch.statuses()
    assert status[0].startswith("error: host mask step failed: IndexError"), status
    assert status[1:] == (None, "complete")


def test_a_token_sampled_outside_its_mask_is_reported(tok):
    """A sampler fault would show as its own error, not as a grammar mismatch."""
    batch = ConstrainedBatch.build(Regex("[0-9]+"), 2, tok, tok.vocab_size)
    masks, _ = batch.initial()
    bad = tok.encode("x")[0]
    good = tok.encode("7")[0]
    _, finished = batch.step(np.asarray([bad, good]), np.ones((2,), bool))
    assert finished.tolist() == [True, False]
    status = batch.statuses()[0]
    assert status == f"error: token {bad} was sampled outside the mask it was sampled under"
    assert batch.statuses()[1] == "complete"


@pytest.mark.heavy
def test_repro_generate_does_not_fail(tok, marathon_lb):
    """The repro itself through generate(): the row runs out of tokens in its long number (or
    completes) instead of failing on a token outside its mask."""
    params = di.load_params(di.default_model_path(), dtype="float32")
    out = di.generate(params, np.asarray([tok.encode("Answer in JSON:")], np.int32),
                      max_new_tokens=192, temperature=1.0, seed=[REPRO_SEED],
                      constraint=JsonSchema(marathon_lb), tokenizer=tok)
    assert out.constraint_status[0] in ("incomplete", "complete"), out.constraint_status
    ids = np.asarray(out.tokens[0, :int(out.lengths[0])]).tolist()
    assert ids[:len(REPRO_TOKENS) - 1] == REPRO_TOKENS[:-1] and REPRO_TOKEN not in ids
