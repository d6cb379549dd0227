"""JSON Schema coverage of structured output: keywords llguidance lacks are rewritten exactly
(dependencies) or into a subset (if/then/else), checked against jsonschema over enumerated
instances; approximated grammars (oneOf as anyOf, uniqueItems, lenient) are checked against the
original schema and a mismatch is the row's status; unsupported keywords are named. Then a
corpus of 296 real-world schemas (tests/data/real_world_schemas.jsonl, SchemaStore): compile
coverage, host-only random walks under the masks (every walk ending with EOS validates), and
the embedded default model on a sample of rows.
"""

import itertools
import json
import pathlib
import random

import numpy as np
import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

import deepinfer_fn as di  # noqa: E402
from deepinfer_fn import structured, text  # noqa: E402
from deepinfer_fn.structured import JsonSchema, Matcher, approximate_schema  # noqa: E402

DATA = pathlib.Path(__file__).parent / "data"
D2020 = "https://json-schema.org/draft/2020-12/schema"
D7 = "http://json-schema.org/draft-07/schema#"


@pytest.fixture(scope="module")
def tok():
    try:
        path = di.default_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"no embedded default model tokenizer: {e}")
    return text.load_tokenizer(path)


def _instances(keys=("a", "b", "c"), values=(1, "x", None)):
    """Every object over `keys` with values from `values` (absent included)."""
    for choice in itertools.product((Ellipsis,) + tuple(values), repeat=len(keys)):
        yield {k: v for k, v in zip(keys, choice) if v is not Ellipsis}


def _valid(schema, value) -> bool:
    return jsonschema.validators.validator_for(schema)(schema).is_valid(value)


def _feed(m: Matcher, tok, s: str, eos: bool = True) -> bool:
    """Consumes the tokens of `s` (then EOS); False at the first refused token."""
    for t in tok.encode(s) + ([tok.eos_id] if eos else []):
        if not m.consume(t):
            return False
    return True


# ---- rewrites, checked against jsonschema ------------------------------------------------------

EXACT = [
    {"$schema": D2020, "properties": {"a": {}, "b": {}, "c": {}},
     "dependentRequired": {"a": ["b"], "c": ["a", "b"]}},
    {"$schema": D7, "dependencies": {"a": ["b", "c"]}},
    {"$schema": D7, "dependencies": {"a": {"properties": {"b": {"type": "integer"}},
                                           "required": ["b"]}}},
    {"$schema": D2020, "dependentSchemas": {"b": {"properties": {"c": {"type": "string"}}}}},
    {"$schema": D7, "if": {"properties": {"a": {"const": 1}}},
     "else": {"required": ["c"]}},
    {"$schema": D7, "properties": {"x": {"dependencies": {"a": ["b"]}}},
     "items": [{"dependencies": {"a": ["c"]}}]},
    {"$schema": D7, "propertyNames": {"type": "string", "pattern": "^[ab]$"},
     "additionalProperties": {"type": ["integer", "null"]}},
    {"$schema": D7, "propertyNames": {"enum": ["a", "c"]}},
    {"$schema": D7, "propertyNames": {"type": "string"}, "properties": {"a": {"type": "null"}}},
]

SUBSET = [
    {"$schema": D7, "not": {"required": ["a"]}},
    {"$schema": D7, "not": {"anyOf": [{"required": ["a"]}, {"required": ["b", "c"]}]}},
    {"$schema": D7, "properties": {"a": {"not": {"type": ["string", "null"]}}},
     "not": {"properties": {"b": {"type": "string"}}, "required": ["b"]}},
    {"$schema": D7, "if": {"properties": {"a": {"const": 1}}, "required": ["a"]},
     "then": {"required": ["b"]}},
    {"$schema": D7, "if": {"properties": {"a": {"type": "string"}}},
     "then": {"properties": {"b": {"type": "integer"}}}, "else": {"required": ["c"]}},
    {"$schema": D7, "properties": {"a": {"enum": [1, "x"]}},
     "allOf": [{"if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
               {"if": {"properties": {"a": {"const": "x"}}}, "then": {"required": ["c"]},
                "else": {"properties": {"c": False}}}]},
]


@pytest.mark.parametrize("schema", EXACT, ids=range(len(EXACT)))
def test_dependency_rewrites_are_exact(schema):
    rewritten, notes = approximate_schema(schema)
    assert notes in ((), ("propertyNames as properties",))
    assert all(k not in json.dumps(rewritten) for k in ("depend", '"if"', "propertyNames"))
    for value in _instances():
        for v in (value, {"x": value}, [value]):
            assert _valid(rewritten, v) == _valid(schema, v), (v, rewritten)


@pytest.mark.parametrize("schema", SUBSET, ids=range(len(SUBSET)))
def test_conditional_rewrites_are_subsets(schema):
    """Every instance the rewritten schema accepts satisfies the original, and it still accepts
    at least a quarter of what the original accepts (over the enumerated instances)."""
    rewritten, notes = approximate_schema(schema)
    assert notes == ("if/then/else",) if "if" in json.dumps(schema) else ("not (a subset)",)
    assert '"not"' not in json.dumps(rewritten)
    accepted = [v for v in _instances() if _valid(rewritten, v)]
    assert accepted and all(_valid(schema, v) for v in accepted)
    assert len(accepted) >= sum(_valid(schema, v) for v in _instances()) / 4


def test_rewrites_leave_property_names_and_values_alone():
    schema = {"type": "object",
              "properties": {"if": {"type": "string", "format": "regex"},
                             "dependencies": {"const": {"dependencies": {"a": ["b"]}}},
                             "uniqueItems": {"type": "array", "uniqueItems": True}},
              "default": {"if": 1}, "examples": [{"then": 2}]}
    rewritten, notes = approximate_schema(schema)
    assert notes == ("uniqueItems not enforced",)
    assert list(rewritten["properties"]) == ["if", "dependencies", "uniqueItems"]
    assert rewritten["properties"]["if"] == {"type": "string"}   # an annotation-only format
    assert rewritten["properties"]["dependencies"] == schema["properties"]["dependencies"]
    assert rewritten["properties"]["uniqueItems"] == {"type": "array"}
    assert rewritten["default"] == {"if": 1} and rewritten["examples"] == [{"then": 2}]


# ---- matchers: the grammar follows the rewrite, approximations are checked ---------------------

def test_dependent_required_is_enforced_by_the_mask(tok):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "dependentRequired": {"a": ["b"]}, "additionalProperties": False}
    for s, ok in [('{"a":1,"b":2}', True), ('{"b":2}', True), ("{}", True), ('{"a":1}', False)]:
        m = Matcher(JsonSchema(schema), tok)
        assert m.error is None and m.approximations == ()
        assert _feed(m, tok, s) == ok, (s, m.error)
        assert m.status() == "complete" if ok else m.status().startswith("error: ")


def test_conditional_is_enforced_by_the_mask(tok):
    """if kind == "tcp" then port required: generated as "port always required"."""
    schema = {"type": "object", "properties": {"kind": {"enum": ["tcp", "udp"]},
                                               "port": {"type": "integer"}},
              "required": ["kind"], "additionalProperties": False,
              "if": {"properties": {"kind": {"const": "tcp"}}}, "then": {"required": ["port"]}}
    m = Matcher(JsonSchema(schema), tok)
    assert m.approximations == ("if/then/else",)
    assert not _feed(m, tok, '{"kind":"tcp"}')
    m = Matcher(JsonSchema(schema), tok)
    assert _feed(m, tok, '{"kind":"udp","port":53}') and m.status() == "complete"


ONE_OF = {"type": "array", "items": {"oneOf": [{"type": "integer", "maximum": 10},
                                               {"type": "integer", "minimum": 5}]}}


@pytest.mark.parametrize("schema, good, bad, note", [
    (ONE_OF, "[1,20]", "[1,7]", "oneOf as anyOf"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1,2]", "[1,1]",
     "uniqueItems not enforced"),
])
def test_approximated_schemas_are_checked_against_the_original(tok, schema, good, bad, note):
    m = Matcher(JsonSchema(schema), tok)
    assert m.error is None and m.approximations == (note,)
    assert _feed(m, tok, good) and m.status() == "complete"
    m = Matcher(JsonSchema(schema), tok)
    assert _feed(m, tok, bad)  # the grammar takes it; the original schema does not
    status = m.status()
    assert status.startswith("error: the output does not satisfy the schema (generated under "
                             f"the approximation {note}): "), status
    assert m.is_finished()


def test_unsupported_keywords_are_named_and_lenient_mode_checks(tok):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "not": {"const": 3}}}}
    m = Matcher(JsonSchema(schema), tok)
    assert m.error.startswith('invalid JsonSchema: unsupported JSON Schema keyword(s) ["not"]')
    assert "lenient" in m.error
    m = Matcher(JsonSchema(schema, options={"lenient": True}), tok)
    assert m.error is None and m.approximations == ('ignored keywords ["not"]',)
    assert _feed(m, tok, '{"a":3}') and m.status().startswith("error: the output does not")
    m = Matcher(JsonSchema(schema, options={"lenient": True}), tok)
    assert _feed(m, tok, '{"a":4}') and m.status() == "complete"


def test_one_of_can_be_kept_strict(tok):
    schema = {"oneOf": [{"type": "object", "properties": {"a": {"type": "string"}}},
                        {"type": "object", "properties": {"b": {"type": "integer"}}}]}
    m = Matcher(JsonSchema(schema, options={"coerce_one_of": False}), tok)
    assert m.error is not None and "oneOf" in m.error


# ---- the real-world corpus ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def corpus():
    with open(DATA / "real_world_schemas.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def compiled(corpus, tok):
    return [Matcher(JsonSchema(row["schema"]), tok) for row in corpus]


def _verdict(schema, s: str) -> str:
    """jsonschema on the original schema: 'valid', 'invalid' or 'unchecked' (the validator
    itself fails, e.g. an ECMA-only regex feature that Python's re lacks)."""
    try:
        value = json.loads(s)
        cls = jsonschema.validators.validator_for(schema)
        return "valid" if cls(schema).is_valid(value) else "invalid"
    except json.JSONDecodeError:
        return "invalid"
    except Exception:  # noqa: BLE001
        return "unchecked"


def test_corpus_compile_coverage(corpus, compiled):
    """At least 78% of the corpus compiles (79.7% when written, 61.8% without the rewrites; most
    of the rest $ref other SchemaStore files, which are not fetched); every other schema fails
    with an error that names its cause."""
    assert len(corpus) >= 250
    failed = [m.error for m in compiled if m.error is not None]
    coverage = 1 - len(failed) / len(corpus)
    assert coverage >= 0.78, coverage
    assert all(e.startswith("invalid JsonSchema: ") and len(e) > 30 for e in failed)


def _walk(m: Matcher, closing, rng, steps=256) -> bool:
    """A random walk under the masks, drawn more and more towards closing characters, and to
    EOS once allowed; True if it ended with EOS."""
    for step in range(steps):
        mask = structured.unpack_mask(m.allowed_mask(), m.vocab_size)
        assert m.error is None, m.error
        if mask[m.eos_id] and rng.random() < 0.7:
            t = m.eos_id
        else:
            towards_end = rng.random() < min(0.8, step / 48)
            cand = np.flatnonzero(mask & closing) if towards_end else np.flatnonzero(mask)
            t = int(rng.choice((cand if len(cand) else np.flatnonzero(mask)).tolist()))
        assert m.consume(t), m.error
        if m.is_finished():
            return True
    return False


def test_corpus_random_walks_validate(corpus, compiled, tok):
    """Host only, every compiled schema: a walk that ends with EOS gives an output the original
    schema accepts, or (approximated grammars only) a status that reports the mismatch."""
    closing = np.array([any(c in tok.decode([v]) for c in '"}],') for v in range(tok.vocab_size)])
    rng = random.Random(0)
    ended = checked = trivial = 0
    for row, m in zip(corpus, compiled):
        if m.error is not None:
            continue
        m = m.copy()
        if not _walk(m, closing, rng):
            continue
        ended += 1
        trivial += len(m.answer_text()) <= 2
        verdict = _verdict(row["schema"], m.answer_text())
        status = m.status()
        if verdict == "unchecked":
            continue
        checked += 1
        if not m.approximations:
            assert verdict == "valid" and status == "complete", (row["name"], m.answer_text())
        else:
            assert (verdict == "valid") == (status == "complete"), (row["name"], status)
    walked = sum(m.error is None for m in compiled)
    assert ended >= 0.8 * walked and checked >= 0.9 * ended, (walked, ended, checked)
    assert trivial <= 0.5 * ended, (trivial, ended)  # mostly more than "{}"


def _default_model():
    from deepinfer_fn.default_model import default_model_path
    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"no embedded default model: {e}")
    return di.load_params(path), text.load_tokenizer(path)


def _generate_rows(corpus, compiled, rows, seed):
    """The default model under `rows` sampled compiled schemas, 4 at a time (the batch, width
    and budget of tests/test_structured.py, so the decode program is shared): per row its
    (status, jsonschema verdict of a complete output or None)."""
    params, dtok = _default_model()
    ok = [i for i, m in enumerate(compiled) if m.error is None]
    sample = random.Random(seed).sample(ok, rows)
    tokens = np.asarray([dtok.encode("def parse(value):\n    return ")] * 4, np.int32)
    results = []
    for k in range(0, rows, 4):
        idx = sample[k:k + 4]
        out = di.generate(params, tokens, max_new_tokens=64, tokenizer=dtok, temperature=0.8,
                          seed=[k, k + 1, k + 2, k + 3],
                          constraint=[JsonSchema(corpus[i]["schema"]) for i in idx])
        for b, i in enumerate(idx):
            status = out.constraint_status[b]
            ids = np.asarray(out.tokens[b, :int(out.lengths[b])]).tolist()
            verdict = None
            if status == "complete" and ids and ids[-1] == dtok.eos_id:
                verdict = _verdict(corpus[i]["schema"], dtok.decode(ids[:-1]))
            results.append((status, verdict))
    return results


def _check_generated(results):
    for status, verdict in results:
        assert status == "complete" or status == "incomplete" or status.startswith(
            "error: the output does not satisfy the schema"), status
        assert verdict in (None, "valid", "unchecked"), (status, verdict)


def test_corpus_default_model_sample(corpus, compiled):
    """Four sampled rows: every status is complete, incomplete (out of tokens) or a reported
    mismatch of an approximated schema, and every complete output validates."""
    _check_generated(_generate_rows(corpus, compiled, 4, seed=1))


@pytest.mark.heavy
def test_corpus_default_model_many_rows(corpus, compiled):
    results = _generate_rows(corpus, compiled, 32, seed=2)
    _check_generated(results)
    assert sum(s == "complete" for s, _ in results) >= 1
