"""JSON Schema keywords llguidance lacks, rewritten into ones it has (`approximate_schema`),
and the check of an output against the original schema (`validation_error`, with the
`jsonschema` package) where the rewrite is only an approximation."""

from __future__ import annotations

import json
from collections.abc import Mapping

from deepinfer_fn.structured.llg import short_message

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



def approximation_name(warning: str) -> str:
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


def validation_error(schema: Mapping, text: str) -> str | None:
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
        return f"could not be checked: {type(e).__name__}: {short_message(str(e))}"
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"at '/{where}': {short_message(error.message)[:200]}"

