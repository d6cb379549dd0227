"""Structured output: regular expressions, JSON schemas and Lark/EBNF grammars (DESIGN.md, "structured").

A constraint is a small frozen spec -- `Regex(pattern)`, `JsonSchema(schema)`, `Grammar(lark_text)` --
compiled per request by llguidance against an llguidance tokenizer built (once per `Tokenizer`) from
our HF `tokenizer.json`. The per-request `Matcher` walks the request's tokens:

    m = Matcher(JsonSchema({...}), tokenizer, vocab_size=cfg.vocab_size)
    packed = m.allowed_mask()      # uint32 [ceil(vocab_size / 32)]: bit t of word t // 32 = token t
    m.consume(token)               # False (and m.error set) if the token was not allowed
    m.rollback(n)                  # undo the last n consumed tokens (rejected speculative drafts)
    m.is_accepting(), m.is_finished(), m.error, m.status()

Token ids, special tokens, vocabulary size:
  * plain tokens are allowed exactly when their bytes extend a string the grammar can still match;
  * special tokens (the tokenizer's added vocabulary: BOS, chat markers, `</think>`, ...) are never
    allowed, except EOS (the tokenizer's `eos_id`), which is allowed exactly when the grammar
    accepts what was generated; once the grammar can extend no further, EOS is the only allowed
    token, and consuming EOS finishes the matcher;
  * the model's `vocab_size` may exceed the tokenizer's (padded embedding rows): the extra ids are
    never allowed.

`think_first=True` (DeepSeek chat, thinking mode): the text is free until the end-of-thinking token
`</think>` (`tokenizer.end_of_thinking_id`), then constrained. While thinking every tokenizer id but
EOS is allowed (the answer must still come); rollback may cross back into the thinking part.

An invalid regex, schema or grammar does not raise: the matcher carries `error` (a one-line message)
and generate() fails that request alone. `ConstrainedBatch` is the host side of generate(): it
consumes each step's sampled tokens and packs the next step's masks for a whole batch (free rows get
all-ones); `unpack_bitmask` turns packed masks into the sampler's bool mask on device.

A mask never allows a token that `consume` refuses (tests/test_structured_masks.py checks this by
brute force over the vocabulary). When llguidance cannot compute a mask (a parser or lexer limit,
an internal error) the row ends with "error: grammar engine could not compute a mask: ..." and an
all-zero mask, never a permissive one; a token outside the mask it was sampled under (a sampler
fault) ends the row with "error: token t was sampled outside the mask it was sampled under".
JSON schemas: keywords llguidance lacks are rewritten, and approximated grammars checked against
the original schema (`JsonSchema`, `approximate_schema`).

How masks reach the jitted decode loop (generate.py `_decode_block`): the packed masks of step i are
part of the `while_loop` carry; after sampling step i, one `io_callback` (unordered: the data
dependency token_i -> mask_{i+1} -> token_{i+1} already orders the calls, and unordered callbacks
also work under a multi-device mesh) hands the tokens to the host, which advances the matchers and
returns mask_{i+1} and the rows the constraint finished. The callback target is one module-level
function and the batch is looked up by an int32 session id, so the program compiles once per shape,
not per request; unconstrained calls trace no callback and no mask at all. The callback does not
depend on the step's forward pass, but neither XLA:CPU nor a GPU stream runs them concurrently
(a 10 ms sleep in the host step adds 10 ms per step), so the host work is on the critical path.
Measured per step (benchmarks/results/structured_mask*.json, V = 129,280, tiny model): H200, B=4:
+2.5 ms (host step 0.8 ms: 4 consumes + 4 masks; the rest the device->host->device round trip);
B=32: +4.3 ms (host 3.4 ms on 16 cores). The engine, which schedules steps from Python anyway, can
overlap the host step with the forward pass instead (DESIGN.md, "engine").

Speculative decoding (generate(..., constraint=..., speculative="mtp" or "dspark"; spec/dspark.md
§2.2, §2.5; the DSpark drafter masks each slot inside its sequential Markov pass, exactly as the MTP
chain does, and additionally caps its verify length -- fixed, random or dynamic -- by the slots the
drafts admit):
a verify step carries m_0, the packed mask after the committed tokens. The drafter draws draft j+1
from its logits masked by m_j (so q, the distribution actually sampled from, is masked and a
forbidden draft is never proposed), and one `host_draft` io_callback per slot consumes the draft
tentatively (`ConstrainedBatch.draft_step`) and returns m_{j+1}. The target logits at verified
position j are masked by m_j (the state after the anchor and x_1..x_j), verification is the usual
lossless one, and one `host_commit` io_callback (`ConstrainedBatch.commit`) rolls each row's
matcher back to its accepted drafts (Matcher.rollback) and consumes the correction/bonus token.
Slots after a drafted EOS (or a draft after which nothing is allowed) are not admitted -- dropping
slot j+1 because of x_j keeps the law, dropping x_j itself because of its value would not; an
accepted EOS draft ends the row and the bonus token after it is dropped (`n_keep`). A drafter
that drafts without masks (all k at once) can call `draft_tokens`: a forbidden draft is then
verified and rejected by the masked target. Host time per verify step, k = 3, V = 129,280
(benchmarks/results/structured_mask_spec.json; 2 CPU cores shared with other jobs, so noisy):
mean 0.55-2.0 ms for B = 1, 26-32 ms for B = 32 across the JSON / regex / grammar cases (k
masks + 1 rollback-and-mask per row), i.e. per committed token (mean g ~1.5) 1.2-2.4x the plain
host step measured in the same run. CPU decode loop, tiny model, B = 4: +28 ms per verify step
(host 9 ms) on a 265 ms free speculative step.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Union

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Regex", "JsonSchema", "Grammar", "Constraint", "Matcher", "ConstrainedBatch",
           "ConstraintError", "ll_tokenizer", "grammar_text", "unpack_bitmask", "pack_mask",
           "unpack_mask", "mask_words"]


@dataclasses.dataclass(frozen=True)
class Regex:
    """The output must fully match `pattern` (Rust `regex` syntax, anchored at both ends)."""

    pattern: str
    think_first: bool = False


@dataclasses.dataclass(frozen=True)
class JsonSchema:
    """The output must be one JSON value valid under `schema` (a dict, or its JSON text).

    `whitespace_flexible=False` (default) emits compact JSON (no whitespace between tokens): a free
    whitespace rule lets a weak or random model pad forever; set it True to allow pretty-printed
    output. `options` are further llguidance JSON compile options (e.g. `item_separator`,
    `key_separator`, `coerce_one_of`, `lenient`); the schema's own "x-guidance" key overrides both.

    Keywords llguidance lacks are rewritten first (`approximate_schema`): `dependentRequired`,
    `dependentSchemas` and `dependencies` exactly (an `anyOf` of "present and ..." / "absent");
    `if`/`then`/`else` and the common forms of `not` (required names, their anyOf, types) by a
    subset (every output still satisfies them); `uniqueItems` is not enforced; string formats llguidance does not know are dropped (they are annotations).
    `oneOf` is generated as `anyOf` (`coerce_one_of`, on by default) where llguidance cannot
    prove the two equal. Whenever the grammar is only an approximation of the schema (a coerced
    `oneOf`, `uniqueItems`, a conditional, `lenient` ignoring keywords), a complete output is
    checked against the original schema (the `jsonschema` package, when installed) and a
    mismatch is the row's status ("error: the output does not satisfy the schema ...").
    Other unsupported keywords (`propertyNames`, other `not`s, ...) fail the request with an error
    naming them; `options={"lenient": True}` ignores them while generating instead (the output
    is then checked as above).
    """

    schema: Union[Mapping, str, bool]
    whitespace_flexible: bool = False
    options: Mapping | None = None
    think_first: bool = False


@dataclasses.dataclass(frozen=True)
class Grammar:
    """The output must match a Lark grammar (llguidance's Lark dialect: EBNF rules, `start` rule,
    /regex/ and "string" terminals, %import common.*, %ignore, special tokens as <|...|>)."""

    lark: str
    think_first: bool = False


Constraint = Union[Regex, JsonSchema, Grammar]


UNSATISFIABLE = "the constraint allows no token here (unsatisfiable)"
MASK_FAILED = "grammar engine could not compute a mask"


class ConstraintError(ValueError):
    """A constraint that cannot be compiled (bad regex / schema / grammar, wrong type)."""


def _llg():
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - a dependency
        raise ImportError("structured output needs the 'llguidance' package "
                          "(pip install 'llguidance>=1.9')") from e
    return llguidance


# ---- JSON schema keywords llguidance lacks, rewritten into ones it has ------------------------------

# Keywords whose value is a subschema, a list of subschemas, or a name -> subschema map.
_SUB_SCHEMA = ("additionalProperties", "additionalItems", "contains", "not", "if", "then", "else",
               "propertyNames", "unevaluatedProperties", "unevaluatedItems", "items")
_SUB_LIST = ("anyOf", "allOf", "oneOf", "prefixItems", "items")
_SUB_MAP = ("properties", "patternProperties", "definitions", "$defs", "dependentSchemas")
# String formats llguidance enforces; others are annotations only (JSON Schema 2020-12, §7.2).
_LLG_FORMATS = frozenset(("date-time", "time", "date", "duration", "email", "hostname", "ipv4",
                          "ipv6", "uuid", "uri"))


def _conditional(node: dict) -> dict | None:
    """A subset of `if A then B else C`, in keywords llguidance has: anyOf[A and B, B and C]
    (both imply the conditional; without `else`: B; without `then`: anyOf[A, C], exact)."""
    a, b, c = node.get("if", True), node.get("then"), node.get("else")
    if b is None and c is None:
        return None
    if c is None:
        return b
    if b is None:
        return {"anyOf": [a, c]}
    return {"anyOf": [{"allOf": [a, b]}, {"allOf": [b, c]}]}


_TYPES = ("null", "boolean", "object", "array", "string", "number", "integer")


def _negation(sub):
    """A schema that implies `not sub`, for the forms schemas use (else None): required names
    (the first one absent; exact for one name), anyOf of those (all absent), a type (the other
    types; "number" and "integer" go together), true/false."""
    if isinstance(sub, bool):
        return not sub
    if not isinstance(sub, dict):
        return None
    if not sub:
        return False
    required = sub.get("required")
    if isinstance(required, list) and required and isinstance(required[0], str):
        return {"type": "object", "properties": {required[0]: False}}
    if set(sub) == {"anyOf"} and isinstance(sub["anyOf"], list) and sub["anyOf"]:
        parts = [_negation(s) for s in sub["anyOf"]]
        return None if any(p is None for p in parts) else {"allOf": parts}
    if set(sub) == {"type"}:
        types = {sub["type"]} if isinstance(sub["type"], str) else set(sub["type"])
        if types & {"number", "integer"}:
            types |= {"number", "integer"}
        rest = [t for t in _TYPES if t not in types]
        return {"type": rest} if rest else False
    return None


def _property_names(node: dict) -> dict | None:
    """`node` (an object schema) with `propertyNames` expressed by keywords llguidance has, for
    the forms schemas use (else None): any string (dropped), a pattern (the names allowed by
    `additionalProperties` become one patternProperty; only without properties and
    patternProperties), an enum of names (each one property, same condition)."""
    names = node["propertyNames"]
    if isinstance(names, dict):
        names = {k: v for k, v in names.items() if k not in ("type", "description", "title")
                 or (k == "type" and v != "string")}
    out = {k: v for k, v in node.items() if k != "propertyNames"}
    if names is True or names == {}:
        return out
    if not isinstance(names, dict) or "properties" in node or "patternProperties" in node:
        return None
    values = node.get("additionalProperties", True)
    if set(names) == {"pattern"} and isinstance(names["pattern"], str):
        return dict(out, patternProperties={names["pattern"]: values}, additionalProperties=False)
    if (set(names) == {"enum"} and isinstance(names["enum"], list)
            and all(isinstance(n, str) for n in names["enum"])):
        return dict(out, properties={n: values for n in names["enum"]}, additionalProperties=False)
    return None


def _dependency(name: str, need) -> dict:
    """`name` absent, or present together with `need` (a list of required names or a schema)."""
    absent = {"properties": {name: False}}
    if isinstance(need, list):
        present = {"required": [name] + [n for n in need if n != name]}
    else:
        present = {"allOf": [{"required": [name]}, need]}
    return {"anyOf": [present, absent]}


def _rewrite(node, notes: set):
    """The schema `node` with the keywords of `approximate_schema` rewritten (a new object)."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _SUB_SCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = _rewrite(out[key], notes)
    for key in _SUB_LIST:
        if isinstance(out.get(key), list):
            out[key] = [_rewrite(v, notes) for v in out[key]]
    for key in _SUB_MAP:
        if isinstance(out.get(key), dict):
            out[key] = {k: _rewrite(v, notes) for k, v in out[key].items()}
    if isinstance(out.get("format"), str) and out["format"] not in _LLG_FORMATS:
        del out["format"]           # an annotation: validators need not check it either
    if out.pop("uniqueItems", False):
        notes.add("uniqueItems not enforced")
    if "propertyNames" in out and _property_names(out) is not None:
        if out["propertyNames"] not in (True, {}, {"type": "string"}):
            notes.add("propertyNames as properties")
        out = _property_names(out)
    extra = []
    if "not" in out and _negation(out["not"]) is not None:
        notes.add("not (a subset)")
        extra.append(_negation(out.pop("not")))
    if any(k in out for k in ("if", "then", "else")):
        cond = _conditional(out)
        if "then" in out:           # without `then` the rewrite is exact
            notes.add("if/then/else")
        for k in ("if", "then", "else"):
            out.pop(k, None)
        if cond is not None:
            extra.append(cond)
    deps = {}
    if isinstance(out.get("dependencies"), dict):
        deps.update({k: _rewrite(v, notes) for k, v in out.pop("dependencies").items()})
    for key in ("dependentRequired", "dependentSchemas"):
        if isinstance(out.get(key), dict):
            deps.update(out.pop(key))
    extra += [_dependency(name, need) for name, need in deps.items()]
    if extra:
        allof = out.get("allOf")
        out["allOf"] = (list(allof) if isinstance(allof, list) else []) + extra
    return out


def approximate_schema(schema: Mapping) -> tuple[dict, tuple[str, ...]]:
    """(schema llguidance can compile, the approximations made): `dependentRequired`,
    `dependentSchemas`, `dependencies` become exact anyOf alternatives; `if`/`then`/`else` a
    subset (`_conditional`), noted "if/then/else"; `not` of the common forms a subset
    (`_negation`), noted "not (a subset)"; `uniqueItems` is dropped (a superset, noted
    "uniqueItems not enforced"); `propertyNames` of a pattern or an enum become
    patternProperties / properties (`_property_names`); a `format` llguidance does not know is
    dropped (exact: formats are annotations unless a validator opts in). `$ref`s keep pointing at the same definitions
    (only keywords inside schema objects change)."""
    notes: set = set()
    return _rewrite(dict(schema), notes), tuple(sorted(notes))


def _json_schema(constraint: "JsonSchema"):
    """The schema of a JsonSchema as a dict (a bool schema as its dict form)."""
    schema = constraint.schema
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ConstraintError(f"JSON schema is not valid JSON: {e}") from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, Mapping):
        raise ConstraintError(f"JSON schema must be an object (dict), got {type(schema).__name__}")
    return dict(schema)


def mask_words(vocab_size: int) -> int:
    """uint32 words of a packed mask over `vocab_size` tokens."""
    return (int(vocab_size) + 31) // 32


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar (JSON text) of a constraint; raises ConstraintError for a value that
    is not even well-formed (a schema that is not JSON, a non-string pattern). Whether the regex /
    schema / grammar itself is valid is found when a Matcher is built."""
    llg = _llg()
    if isinstance(constraint, Regex):
        if not isinstance(constraint.pattern, str):
            raise ConstraintError(f"Regex pattern must be a str, got {type(constraint.pattern).__name__}")
        return llg.LLMatcher.grammar_from_regex(constraint.pattern)
    if isinstance(constraint, Grammar):
        if not isinstance(constraint.lark, str):
            raise ConstraintError(f"Grammar text must be a str, got {type(constraint.lark).__name__}")
        return llg.LLMatcher.grammar_from_lark(constraint.lark)
    if isinstance(constraint, JsonSchema):
        schema, _ = approximate_schema(_json_schema(constraint))
        defaults = {"whitespace_flexible": bool(constraint.whitespace_flexible),
                    "coerce_one_of": True}
        defaults.update(constraint.options or {})
        try:
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
        except (ValueError, TypeError) as e:
            raise ConstraintError(f"JSON schema could not be read: {e}") from None
    raise ConstraintError(f"constraint must be deepinfer_fn.Regex, JsonSchema or Grammar, got "
                          f"{type(constraint).__name__}")


_DEFAULT_TOKENIZER = None


def default_tokenizer():
    """The DeepSeek-V4 vocabulary (`text.load_tokenizer()`), loaded once."""
    global _DEFAULT_TOKENIZER
    if _DEFAULT_TOKENIZER is None:
        from deepinfer_fn import text
        _DEFAULT_TOKENIZER = text.load_tokenizer()
    return _DEFAULT_TOKENIZER


_LL_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LL_LOCK = threading.Lock()


def ll_tokenizer(tokenizer):
    """The llguidance tokenizer of a `deepinfer_fn.text.Tokenizer` (built once per tokenizer
    object: about a second for the 129,280-token V4 vocabulary). EOS = the tokenizer's eos_id;
    the added vocabulary is special (never matched by grammar text)."""
    with _LL_LOCK:
        lt = _LL_TOKENIZERS.get(tokenizer)
        if lt is None:
            if tokenizer.eos_id is None:
                raise ConstraintError(f"{tokenizer!r} has no EOS token: a constrained request "
                                      f"could never end")
            llg = _llg()
            lt = llg.LLTokenizer(tokenizer._tok.to_str(), n_vocab=tokenizer.vocab_size,
                                 eos_token=int(tokenizer.eos_id))
            _LL_TOKENIZERS[tokenizer] = lt
        return lt


def _short(message: str) -> str:
    """llguidance's first line of an error (its verbose state dump follows)."""
    line = message.strip().split("\n<state>")[0].strip()
    return " ".join(line.split()) or "unknown error"


def _compile_error(constraint, message: str) -> str:
    """The error of a constraint llguidance refused; unsupported JSON Schema keywords named."""
    kind = type(constraint).__name__
    if isinstance(constraint, JsonSchema) and message.startswith("Unimplemented keys:"):
        keys = message.split(":", 1)[1].strip()
        return (f"invalid {kind}: unsupported JSON Schema keyword(s) {keys} (JsonSchema(..., "
                f"options={{'lenient': True}}) ignores them while generating and checks the "
                f"output against the full schema)")
    return f"invalid {kind}: {message}"


def _approximation(warning: str) -> str:
    """A short name for an llguidance JSON-compile warning (how the grammar departs)."""
    if warning.startswith("oneOf not fully supported"):
        return "oneOf as anyOf"
    if warning.startswith("Unimplemented keys:"):
        return "ignored keywords " + warning.split(":", 1)[1].strip()
    if warning.startswith("Unknown format:"):
        return "ignored format " + warning.split(":", 1)[1].strip()
    return warning


def _jsonschema():
    """The `jsonschema` and `referencing` modules, or None when they are not installed."""
    try:
        import jsonschema
        import referencing
        import referencing.exceptions
    except ImportError:  # pragma: no cover - an optional dependency
        return None
    return jsonschema, referencing


def _validation_error(schema: Mapping, text: str) -> str | None:
    """None if `text` is one JSON value valid under `schema` (or jsonschema is not installed),
    else why not (one line). Only references inside the schema resolve (nothing is fetched)."""
    modules = _jsonschema()
    if modules is None:  # pragma: no cover
        return None
    jsonschema, referencing = modules
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return f"not JSON: {e}"

    def refuse(uri):
        raise referencing.exceptions.NoSuchResource(ref=uri)

    try:
        cls = jsonschema.validators.validator_for(schema)
        validator = cls(schema, registry=referencing.Registry(retrieve=refuse))
        error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    except Exception as e:  # noqa: BLE001 - an unresolvable $ref, a malformed keyword
        return f"could not be checked: {type(e).__name__}: {_short(str(e))}"
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"at '/{where}': {_short(error.message)[:200]}"


def pack_mask(allowed) -> np.ndarray:
    """bool [..., V] -> uint32 [..., ceil(V/32)] (bit t % 32 of word t // 32 is token t)."""
    allowed = np.asarray(allowed, bool)
    V = allowed.shape[-1]
    pad = mask_words(V) * 32 - V
    bits = np.pad(allowed, [(0, 0)] * (allowed.ndim - 1) + [(0, pad)])
    return np.packbits(bits, axis=-1, bitorder="little").view(np.uint32)


def unpack_mask(packed, vocab_size: int) -> np.ndarray:
    """Host inverse of pack_mask: uint32 [..., W] -> bool [..., vocab_size]."""
    packed = np.ascontiguousarray(packed, np.uint32)
    bits = np.unpackbits(packed.view(np.uint8), axis=-1, bitorder="little")
    return bits[..., :vocab_size].astype(bool)


def unpack_bitmask(packed: jax.Array, vocab_size: int) -> jax.Array:
    """Device unpack (jittable): uint32 [B, W] -> bool [B, vocab_size], the sampler's allowed_mask."""
    shifts = jnp.arange(32, dtype=jnp.uint32)
    bits = (packed[..., None] >> shifts) & jnp.uint32(1)
    return bits.reshape(*packed.shape[:-1], packed.shape[-1] * 32)[..., :vocab_size] != 0


class Matcher:
    """One request's constraint state over the model's vocabulary (see the module docstring).

    `vocab_size` is the model's (default: the tokenizer's); it must be >= the tokenizer's.
    `limits`: llguidance parser limits (`llguidance.LLParserLimits` keyword names, e.g.
    `step_max_items`); a mask step that exceeds one ends the request with an error.
    Never raises for a bad constraint: check `error` (a one-line message) instead.
    `approximations` names how a JsonSchema's grammar departs from the schema (empty: exact);
    when it is not empty, `status()` checks a complete output against the original schema.
    """

    def __init__(self, constraint: Constraint, tokenizer, vocab_size: int | None = None, *,
                 limits: Mapping | None = None):
        V_tok = int(tokenizer.vocab_size)
        self.vocab_size = V_tok if vocab_size is None else int(vocab_size)
        if self.vocab_size < V_tok:
            raise ValueError(f"model vocab_size {self.vocab_size} is smaller than the tokenizer's "
                             f"{V_tok}: the tokenizer does not belong to this model")
        self.constraint = constraint
        self.eos_id = int(tokenizer.eos_id) if tokenizer.eos_id is not None else None
        self.words = mask_words(self.vocab_size)
        self.think_first = bool(getattr(constraint, "think_first", False))
        self.end_of_thinking_id = tokenizer.end_of_thinking_id
        self.error: str | None = None
        self.approximations: tuple[str, ...] = ()
        self._schema = None           # the original JSON schema (validated when approximated)
        self._answer_ids: list[int] = []   # grammar tokens consumed, EOS excluded
        self._checked: tuple[int, str | None] | None = None  # (len(_answer_ids), mismatch)
        self._thinking = self.think_first
        self._think_tokens = 0      # tokens consumed while thinking, </think> included
        self._answer_tokens = 0     # tokens consumed by the grammar, EOS included
        self._eos_consumed = False
        self._ll = None
        if self.think_first and self.end_of_thinking_id is None:
            self.error = f"think_first: {tokenizer!r} has no {'</think>'!r} token"
            return
        try:
            lt = ll_tokenizer(tokenizer)
            self._lt = lt
            self._ll_words = mask_words(lt.vocab_size)
            self._tok_vocab = lt.vocab_size
            grammar = grammar_text(constraint)
            llg = _llg()
            self._ll = llg.LLMatcher(lt, grammar, log_level=0,
                                     limits=None if limits is None else llg.LLParserLimits(**limits))
        except ConstraintError as e:
            self.error = str(e)
            return
        self._scratch = np.zeros((self._ll_words,), np.uint32)
        if self._ll.is_error():
            self.error = _compile_error(constraint, _short(self._ll.get_error()))
        elif isinstance(constraint, JsonSchema):
            self._schema = _json_schema(constraint)
            notes = set(approximate_schema(self._schema)[1])
            notes.update(_approximation(_short(w)) for w in self._ll.get_grammar_warnings())
            self.approximations = tuple(sorted(notes))

    # ---- state ------------------------------------------------------------------------------

    @property
    def thinking(self) -> bool:
        """True while a think_first request is still before its `</think>`."""
        return self._thinking

    def is_accepting(self) -> bool:
        """The answer so far is a complete match (EOS would be allowed now)."""
        if self.error is not None or self._thinking:
            return False
        return self._eos_consumed or self._ll.is_accepting()

    def is_finished(self) -> bool:
        """Nothing more can be generated: EOS consumed, or an error."""
        return self.error is not None or self._eos_consumed

    def is_complete(self) -> bool:
        """The grammar can extend no further (EOS is the only allowed token) or EOS was consumed."""
        if self.error is not None or self._thinking:
            return False
        return self._eos_consumed or self._ll.is_stopped()

    def status(self) -> str:
        """'complete' (a full match), 'incomplete' (the text so far is only a prefix of one),
        or 'error: <message>' -- also for a complete output of an approximated JSON schema
        that the original schema rejects."""
        if self.error is not None:
            return f"error: {self.error}"
        if not self.is_accepting():
            return "incomplete"
        mismatch = self.schema_mismatch()
        if mismatch is not None:
            return (f"error: the output does not satisfy the schema (generated under the "
                    f"approximation {', '.join(self.approximations)}): {mismatch}")
        return "complete"

    def answer_text(self) -> str:
        """The constrained text consumed so far (after `</think>`, EOS excluded)."""
        return self._lt.decode_bytes(self._answer_ids).decode("utf-8", errors="replace")

    def schema_mismatch(self) -> str | None:
        """For an approximated JSON schema: why the text so far fails the original schema
        (None: it passes, or nothing to check). Checked once per text length."""
        if not self.approximations or self._schema is None:
            return None
        n = len(self._answer_ids)
        if self._checked is None or self._checked[0] != n:
            self._checked = (n, _validation_error(self._schema, self.answer_text()))
        return self._checked[1]

    # ---- masks ------------------------------------------------------------------------------

    def _think_mask(self, out: np.ndarray):
        out[:] = 0
        full, rest = divmod(self._tok_vocab, 32)
        out[:full] = 0xFFFFFFFF
        if rest:
            out[full] = (1 << rest) - 1
        if self.eos_id is not None:
            out[self.eos_id // 32] &= ~np.uint32(1 << (self.eos_id % 32))

    def fill_mask(self, out: np.ndarray, ll_mask: np.ndarray | None = None, *,
                  empty_is_error: bool = True):
        """Writes the packed allowed-token mask (uint32 [words]) into `out`. `ll_mask` is the
        llguidance mask when already computed (batched by ConstrainedBatch). An error or an
        empty mask sets `error`, and the mask is all-zero. `empty_is_error=False` (a state
        reached by a speculative draft, which may still be rejected) leaves an empty mask
        all-zero without setting `error`: the caller decides once the draft is committed."""
        if self.error is not None or self._eos_consumed:
            out[:] = 0
            return
        if self._thinking:
            self._think_mask(out)
            return
        if ll_mask is None:
            ll_mask = self._scratch
            self._ll.unsafe_compute_mask_ptr(ll_mask.ctypes.data, ll_mask.nbytes)
        if self._ll.is_error():  # never a permissive mask: llguidance writes EOS-only ones
            self.mask_failed()
            out[:] = 0
            return
        n = self._ll_words
        out[:n] = ll_mask
        out[n:] = 0
        rest = self._tok_vocab % 32
        if rest:
            out[n - 1] &= np.uint32((1 << rest) - 1)
        if empty_is_error and not out.any():
            self.error = UNSATISFIABLE

    def mask_failed(self):
        """Records llguidance's failure to compute the next mask (a limit, an internal error)."""
        if self.error is None:
            self.error = f"{MASK_FAILED}: {_short(self._ll.get_error())}"

    def allowed_mask(self) -> np.ndarray:
        """Packed mask of the tokens allowed next: uint32 [ceil(vocab_size / 32)]."""
        out = np.zeros((self.words,), np.uint32)
        self.fill_mask(out)
        return out

    # ---- tokens -----------------------------------------------------------------------------

    def consume(self, token: int) -> bool:
        """Advances by one sampled token; False (and `error` set) if it was not allowed."""
        if self.error is not None:
            return False
        token = int(token)
        if self._thinking:
            if token == self.eos_id or not 0 <= token < self._tok_vocab:
                self.error = f"token {token} is not allowed while thinking"
                return False
            self._think_tokens += 1
            if token == self.end_of_thinking_id:
                self._thinking = False
            return True
        if self._eos_consumed:
            self.error = f"token {token} after EOS"
            return False
        if token == self.eos_id:  # kept out of llguidance (whose history may skip it)
            if not self._ll.is_accepting():
                self.error = f"EOS (token {token}) before the constraint is complete"
                return False
            self._answer_tokens += 1
            self._eos_consumed = True
            return True
        if not 0 <= token < self._tok_vocab or not self._ll.consume_token(token):
            self.error = (f"token {token} does not satisfy the constraint"
                          + (f": {_short(self._ll.get_error())}" if self._ll.is_error() else ""))
            return False
        self._answer_tokens += 1
        self._answer_ids.append(token)
        return True

    def consume_many(self, tokens: Sequence[int]) -> int:
        """Consumes tokens until one is rejected; returns how many were consumed."""
        for n, t in enumerate(tokens):
            if not self.consume(t):
                return n
        return len(tokens)

    def rollback(self, n: int) -> bool:
        """Undoes the last `n` consumed tokens (e.g. rejected speculative drafts). False if n
        exceeds what was consumed; an error state is never rolled back."""
        n = int(n)
        if self.error is not None or n < 0 or n > self._think_tokens + self._answer_tokens:
            return False
        k = min(n, self._answer_tokens)
        if k:
            ll_k = k - int(self._eos_consumed)
            if ll_k and not self._ll.rollback(ll_k):
                self.error = f"rollback failed: {_short(self._ll.get_error())}"
                return False
            if ll_k:
                del self._answer_ids[-ll_k:]
            self._answer_tokens -= k
            self._eos_consumed = False
        if n > k:  # back into the thinking part: </think> itself is undone
            self._think_tokens -= n - k
            self._thinking = True
        return True


_EXECUTOR = None


def _executor():
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = _llg().LLExecutor()
    return _EXECUTOR


class ConstrainedBatch:
    """Host side of constrained generate(): one Matcher (or None = free row) per batch row.

    `initial()` gives the first step's packed masks and the rows already finished (those whose
    constraint failed to compile); `step(tokens, active)` consumes each active row's sampled token
    and returns the next packed masks and the rows the constraint finished (EOS consumed, error).
    Free and finished rows get all-ones masks (no restriction: the sampler output is unchanged).
    """

    def __init__(self, matchers: Sequence[Matcher | None], vocab_size: int):
        self.matchers = list(matchers)
        self.vocab_size = int(vocab_size)
        self.words = mask_words(vocab_size)
        B = len(self.matchers)
        self._masks = np.full((B, self.words), 0xFFFFFFFF, np.uint32)
        ll_words = {m._ll_words for m in self.matchers if m is not None and m._ll is not None}
        self._ll_words = ll_words.pop() if len(ll_words) == 1 else None
        self._scratch = (np.zeros((B, self._ll_words), np.uint32)
                         if self._ll_words is not None else None)
        self.step_seconds: list[float] = []
        self._reset_drafts(B)
        self.draft_seconds: list[float] = []    # speculative: per draft_step call
        self.commit_seconds: list[float] = []   # speculative: per commit call

    def _reset_drafts(self, rows: int):
        """Per-row speculative bookkeeping of the current verify step."""
        self._drafted = np.zeros((rows,), np.int64)   # drafts consumed (tentatively)
        self._halted = np.zeros((rows,), bool)        # no further draft is consumed this step
        self._dead_end = np.zeros((rows,), np.int64)  # slot whose state allows nothing (0: none)

    @classmethod
    def build(cls, constraint, batch: int, tokenizer, vocab_size: int) -> "ConstrainedBatch":
        """One constraint for all rows, or a sequence of length `batch` (None = free row)."""
        if constraint is None:
            raise ValueError("no constraint")
        if isinstance(constraint, (Regex, JsonSchema, Grammar)):
            specs = [constraint] * batch
        elif isinstance(constraint, Sequence) and not isinstance(constraint, (str, bytes)):
            specs = list(constraint)
            if len(specs) != batch:
                raise ValueError(f"constraint: expected one constraint or a list of {batch} "
                                 f"(None for a free row), got a list of {len(specs)}")
        else:
            raise TypeError(f"constraint must be deepinfer_fn.Regex, JsonSchema, Grammar or a list "
                            f"of them (None for free rows), got {type(constraint).__name__}")
        for s in specs:
            if s is not None and not isinstance(s, (Regex, JsonSchema, Grammar)):
                raise TypeError(f"constraint list entries must be Regex, JsonSchema, Grammar or "
                                f"None, got {type(s).__name__}")
        cache: dict[int, Matcher] = {}
        matchers = []
        for s in specs:
            if s is None:
                matchers.append(None)
            else:  # the same spec object in several rows compiles once, then is copied
                if id(s) not in cache:
                    cache[id(s)] = Matcher(s, tokenizer, vocab_size)
                    matchers.append(cache[id(s)])
                else:
                    matchers.append(cache[id(s)]._copy())
        return cls(matchers, vocab_size)

    def pad_rows(self, rows: int):
        """Extends the batch with free rows up to `rows` (mesh padding)."""
        extra = rows - len(self.matchers)
        if extra > 0:
            self.matchers += [None] * extra
            self._masks = np.concatenate(
                [self._masks, np.full((extra, self.words), 0xFFFFFFFF, np.uint32)])
            if self._scratch is not None:
                self._scratch = np.zeros((rows, self._ll_words), np.uint32)
            self._reset_drafts(rows)

    def _fill(self, rows, empty_is_error: bool = True):
        """Next masks of `rows` into self._masks; llguidance rows in one parallel call."""
        ll_rows = [b for b in rows if self.matchers[b].error is None
                   and not self.matchers[b].thinking]
        if len(ll_rows) > 1 and self._scratch is not None:
            _executor().unsafe_compute_mask_ptr(
                [(self.matchers[b]._ll, b) for b in ll_rows], self._scratch.ctypes.data,
                self._ll_words * 4, self._scratch.shape[0])
            ll_set = set(ll_rows)
            for b in rows:
                self.matchers[b].fill_mask(self._masks[b],
                                           self._scratch[b] if b in ll_set else None,
                                           empty_is_error=empty_is_error)
        else:
            for b in rows:
                self.matchers[b].fill_mask(self._masks[b], empty_is_error=empty_is_error)

    def initial(self) -> tuple[np.ndarray, np.ndarray]:
        rows = [b for b, m in enumerate(self.matchers) if m is not None]
        self._fill(rows)
        finished = np.array([m is not None and m.is_finished() for m in self.matchers])
        self._masks[finished] = 0xFFFFFFFF
        return self._masks.copy(), finished

    def step(self, tokens, active) -> tuple[np.ndarray, np.ndarray]:
        t0 = time.perf_counter()
        tokens = np.asarray(tokens)
        active = np.asarray(active, bool)
        finished = np.zeros((len(self.matchers),), bool)
        live = []
        for b, m in enumerate(self.matchers):
            if m is None or not active[b]:
                continue
            self._consume_sampled(m, b, int(tokens[b]))
            if m.is_finished():
                finished[b] = True
                self._masks[b] = 0xFFFFFFFF
            else:
                live.append(b)
        self._fill(live)
        for b in live:
            if self.matchers[b].is_finished():  # the mask step found an error
                finished[b] = True
                self._masks[b] = 0xFFFFFFFF
        self.step_seconds.append(time.perf_counter() - t0)
        return self._masks.copy(), finished

    def _consume_sampled(self, m: Matcher, b: int, t: int):
        """Row b consumes the token sampled under its last mask; a token outside that mask (a
        sampler fault: the mask is exact) ends the row with an error saying so."""
        if not m.is_finished() and not (
                0 <= t < self.vocab_size and (int(self._masks[b, t >> 5]) >> (t & 31)) & 1):
            m.error = f"token {t} was sampled outside the mask it was sampled under"
            return
        m.consume(t)

    def statuses(self) -> tuple[str | None, ...]:
        return tuple(None if m is None else m.status() for m in self.matchers)

    # ---- speculative decoding: masks at draft positions, rollback of rejected drafts ----------
    #
    # One verify step of a row whose committed tokens the matcher has consumed (its mask m_0 =
    # the last mask returned): `draft_step` is called once per draft slot j = 1..k with the
    # drafts x_j; it consumes x_j tentatively and returns m_j, the mask after x_1..x_j, which
    # both masks the drafter's q for x_{j+1} and, with m_0..m_{j-1}, the target distributions
    # p~_j of the verification (spec/dspark.md §2.2). `commit` then rolls every row back to its
    # accepted drafts and consumes the correction/bonus token. A drafter that proposes all k
    # drafts at once (no per-slot mask for q) uses `draft_tokens` instead of k draft_steps.
    #
    # Lossless rules (§2.5): a draft is never dropped because of its own value. A draft the
    # grammar forbids (possible only with an unmasked q) is not consumed and the row drafts
    # no further this step (`halted`): it is verified like any other and rejected, since the
    # masked p~ gives it probability 0; the later slots' masks are all-ones and unused. A
    # draft after which the constraint is finished (EOS) or allows nothing (a dead end) sets
    # `stop`: the *later* slots are not admitted (ell <= j, decided from x_j, which is
    # allowed); the draft itself is verified, and if it is accepted the row ends there.

    def draft_step(self, tokens, active) -> tuple[np.ndarray, np.ndarray]:
        """Consumes each active row's next draft token (int [B]) tentatively; returns
        (packed masks uint32 [B, W] after it, stop bool [B]: slots after this one must not be
        admitted). Free, finished and halted rows get all-ones masks."""
        t0 = time.perf_counter()
        tokens = np.asarray(tokens)
        active = np.asarray(active, bool)
        stop = np.zeros((len(self.matchers),), bool)
        live = []
        for b, m in enumerate(self.matchers):
            if m is None or not active[b] or m.is_finished() or self._halted[b]:
                if m is not None and active[b] and not m.is_finished():
                    self._masks[b] = 0xFFFFFFFF
                continue
            t = int(tokens[b])
            if not (0 <= t < self.vocab_size
                    and (int(self._masks[b, t >> 5]) >> (t & 31)) & 1):
                self._halted[b] = True          # forbidden draft: verified, rejected
                self._masks[b] = 0xFFFFFFFF
                continue
            if not m.consume(t):  # pragma: no cover - the mask said it was allowed
                self._halted[b] = True           # the row's error is reported at commit
                self._masks[b] = 0xFFFFFFFF
                continue
            self._drafted[b] += 1
            if m.is_finished():                  # EOS drafted: admit nothing after it
                stop[b] = self._halted[b] = True
                self._masks[b] = 0xFFFFFFFF
            else:
                live.append(b)
        self._fill(live, empty_is_error=False)
        for b in live:
            m = self.matchers[b]
            if m.error is not None:              # an llguidance failure: reported at commit
                stop[b] = self._halted[b] = True
                self._masks[b] = 0xFFFFFFFF
            elif not self._masks[b].any():       # dead end after this draft
                self._dead_end[b] = self._drafted[b]
                stop[b] = self._halted[b] = True
                self._masks[b] = 0xFFFFFFFF
        self.draft_seconds.append(time.perf_counter() - t0)
        return self._masks.copy(), stop

    def draft_tokens(self, drafts, active) -> tuple[np.ndarray, np.ndarray]:
        """All k drafts at once (int [B, k]): `draft_step` per slot. Returns (packed masks
        uint32 [B, k+1, W]: m_0 (the current masks) .. m_k, admit int32 [B]: the largest
        verify length allowed by the drafts, k unless a draft finished the constraint)."""
        drafts = np.asarray(drafts)
        B, k = drafts.shape
        masks = [self._masks.copy()]
        admit = np.full((B,), k, np.int32)
        for j in range(k):
            m, stop = self.draft_step(drafts[:, j], active)
            masks.append(m)
            admit = np.where(stop & (admit == k), j + 1, admit).astype(np.int32)
        return np.stack(masks, axis=1), admit

    def commit(self, tokens, accepted, n_emit, active) -> tuple[np.ndarray, np.ndarray,
                                                                  np.ndarray]:
        """End of a verify step. tokens int [B, k+1]: the emitted tokens (accepted drafts, then
        the correction/bonus token); accepted int [B]: g, how many drafts were accepted;
        n_emit int [B]: how many of `tokens` the row commits (g + 1, or fewer when a stop token
        or the budget cut it). Each active constrained row is rolled back to its first
        min(g, n_emit) drafts, then consumes the rest of its committed tokens until the
        constraint finishes. Returns (next packed masks uint32 [B, W], finished bool [B]: rows
        the constraint ended (EOS consumed, error), n_keep int32 [B]: committed tokens that
        stay in the output (fewer than n_emit only after an accepted EOS draft); free and
        inactive rows keep n_emit)."""
        t0 = time.perf_counter()
        tokens = np.asarray(tokens)
        accepted = np.asarray(accepted).astype(np.int64)
        n_emit = np.asarray(n_emit).astype(np.int64)
        active = np.asarray(active, bool)
        B = len(self.matchers)
        finished = np.zeros((B,), bool)
        n_keep = np.where(active, n_emit, 0).astype(np.int32)
        live = []
        for b, m in enumerate(self.matchers):
            if m is None or not active[b]:
                continue
            drafted, dead_end = int(self._drafted[b]), int(self._dead_end[b])
            keep = min(int(accepted[b]), int(n_emit[b]), drafted)
            if m.error is None and drafted > keep and not m.rollback(drafted - keep):
                pass  # rollback failed: m.error is set, the row ends below
            kept = keep
            if m.error is None and dead_end and keep >= dead_end:
                m.error = UNSATISFIABLE
            for t in tokens[b, keep:int(n_emit[b])]:
                if m.is_finished():
                    break
                m.consume(int(t))
                kept += 1
            n_keep[b] = kept
            if m.is_finished():
                finished[b] = True
                self._masks[b] = 0xFFFFFFFF
            else:
                live.append(b)
        self._reset_drafts(B)
        self._fill(live)
        for b in live:
            if self.matchers[b].is_finished():  # the mask step found an error
                finished[b] = True
                self._masks[b] = 0xFFFFFFFF
        self.commit_seconds.append(time.perf_counter() - t0)
        return self._masks.copy(), finished, n_keep


def _matcher_copy(self: Matcher) -> Matcher:
    """A fresh matcher of the same compiled constraint (llguidance deep copy, state included)."""
    new = object.__new__(Matcher)
    new.__dict__.update(self.__dict__)
    if self._ll is not None:
        new._ll = self._ll.deep_copy()
        new._scratch = np.zeros_like(self._scratch)
    new._answer_ids = list(self._answer_ids)
    return new


Matcher._copy = _matcher_copy


# ---- the jitted decode loop's host callback: a registry of live batches ---------------------------

_SESSIONS: dict[int, ConstrainedBatch] = {}
_SESSION_IDS = itertools.count(1)


def register(batch: ConstrainedBatch) -> int:
    sid = next(_SESSION_IDS) & 0x7FFFFFFF
    _SESSIONS[sid] = batch
    return sid


def unregister(sid: int):
    _SESSIONS.pop(sid, None)


def _host_failure(batch: ConstrainedBatch, e: Exception):
    """All-ones masks, and every live constrained row ended with an error."""
    masks = np.full((len(batch.matchers), batch.words), 0xFFFFFFFF, np.uint32)
    finished = np.zeros((len(batch.matchers),), bool)
    for b, m in enumerate(batch.matchers):
        if m is not None and not m.is_finished():
            m.error = f"host mask step failed: {type(e).__name__}: {e}"
            finished[b] = True
    batch._reset_drafts(len(batch.matchers))
    return masks, finished


def host_draft(session, tokens, active):
    """io_callback target of a speculative draft slot: (session id, draft tokens [B], active
    [B]) -> (packed masks [B,W] uint32 after the drafts so far, stop [B] bool: admit no later
    slot). Never raises: a failure marks the affected rows as errors (reported at commit)."""
    batch = _SESSIONS[int(session)]
    try:
        return batch.draft_step(tokens, active)
    except Exception as e:  # noqa: BLE001 - a host failure must not take down the device loop
        masks, finished = _host_failure(batch, e)
        batch._halted[:] = True
        return masks, finished


def host_commit(session, tokens, accepted, n_emit, active):
    """io_callback target of a speculative verify step's end: (session id, emitted tokens
    [B,k+1], accepted drafts g [B], committed count [B], active [B]) -> (packed masks [B,W]
    uint32 for the next step, finished [B] bool, n_keep [B] int32). Never raises."""
    batch = _SESSIONS[int(session)]
    try:
        return batch.commit(tokens, accepted, n_emit, active)
    except Exception as e:  # noqa: BLE001
        masks, finished = _host_failure(batch, e)
        return masks, finished, np.where(np.asarray(active, bool), n_emit, 0).astype(np.int32)


def host_step(session, tokens, active):
    """io_callback target: (session id, sampled tokens [B], active [B]) -> (packed masks [B,W]
    uint32, finished [B] bool). Never raises: a failure marks the affected rows as errors."""
    batch = _SESSIONS[int(session)]
    try:
        return batch.step(tokens, active)
    except Exception as e:  # noqa: BLE001 - a host failure must not take down the device loop
        return _host_failure(batch, e)
