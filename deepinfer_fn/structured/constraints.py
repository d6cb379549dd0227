"""Constraint types: `Regex(pattern)`, `JsonSchema(schema)`, `Grammar(lark_text)` (small frozen
specs, one per request), `ConstraintError`, and their llguidance grammar text (`grammar_text`).

Each takes `think_first=True` (DeepSeek chat, thinking mode): the text is free until the
end-of-thinking token `</think>`, then constrained (`Matcher`)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Union

from deepinfer_fn.structured import llg
from deepinfer_fn.structured.schema import approximate_schema

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
    subset (every output still satisfies them); `uniqueItems` is not enforced; string formats
    llguidance does not know are dropped (they are annotations).
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


class ConstraintError(ValueError):
    """A constraint that cannot be compiled (bad regex / schema / grammar, wrong type)."""


def json_schema(constraint: JsonSchema) -> dict:
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


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar (JSON text) of a constraint; raises ConstraintError for a value that
    is not even well-formed (a schema that is not JSON, a non-string pattern). Whether the regex /
    schema / grammar itself is valid is found when a Matcher is built."""
    ll = llg.module()
    if isinstance(constraint, Regex):
        if not isinstance(constraint.pattern, str):
            raise ConstraintError(f"Regex pattern must be a str, got {type(constraint.pattern).__name__}")
        return ll.LLMatcher.grammar_from_regex(constraint.pattern)
    if isinstance(constraint, Grammar):
        if not isinstance(constraint.lark, str):
            raise ConstraintError(f"Grammar text must be a str, got {type(constraint.lark).__name__}")
        return ll.LLMatcher.grammar_from_lark(constraint.lark)
    if isinstance(constraint, JsonSchema):
        schema, _ = approximate_schema(json_schema(constraint))
        defaults = {"whitespace_flexible": bool(constraint.whitespace_flexible),
                    "coerce_one_of": True}
        defaults.update(constraint.options or {})
        try:
            return ll.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
        except (ValueError, TypeError) as e:
            raise ConstraintError(f"JSON schema could not be read: {e}") from None
    raise ConstraintError(f"constraint must be deepinfer_fn.Regex, JsonSchema or Grammar, got "
                          f"{type(constraint).__name__}")

