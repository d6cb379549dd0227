"""Reusable argument checks for the public boundary.

Each check takes `where` (the function, e.g. "generate"), the argument's name and its value,
and returns the value normalized (a Python int / float / dtype) or raises `ArgumentTypeError`
(wrong kind) / `ArgumentError` (out of range) with a message naming the argument, the value
and what is allowed: "generate: max_new_tokens must be a positive int, got True (bool)".
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from deepinfer_fn.errors import ArgumentError, ArgumentTypeError


def describe(value) -> str:
    """`value!r (type)`, short."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def _prefix(where: str, name: str) -> str:
    return f"{where}: {name}" if where else name


def is_int(value) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_number(value) -> bool:
    """An int or a float (Python or numpy), not a bool."""
    return is_int(value) or isinstance(value, (float, np.floating))


def integer(where: str, name: str, value, what: str = "an int") -> int:
    if not is_int(value):
        hint = " (pass a whole number, e.g. int(x))" if isinstance(value, (float, np.floating)) else ""
        raise ArgumentTypeError(f"{_prefix(where, name)} must be {what}, got {describe(value)}{hint}")
    return int(value)


def positive_int(where: str, name: str, value) -> int:
    value_ = integer(where, name, value, "a positive int")
    if value_ < 1:
        raise ArgumentError(f"{_prefix(where, name)} must be a positive int, got {describe(value)}")
    return value_


def non_negative_int(where: str, name: str, value) -> int:
    value_ = integer(where, name, value, "a non-negative int")
    if value_ < 0:
        raise ArgumentError(f"{_prefix(where, name)} must be a non-negative int, got "
                            f"{describe(value)}")
    return value_


def int_in(where: str, name: str, value, lo: int, hi: int) -> int:
    """An int in [lo, hi) (hi None: no upper bound)."""
    span = f"in [{lo}, {hi})" if hi is not None else f">= {lo}"
    value_ = integer(where, name, value, f"an int {span}")
    if value_ < lo or (hi is not None and value_ >= hi):
        raise ArgumentError(f"{_prefix(where, name)} must be an int {span}, got {describe(value)}")
    return value_


def float_in(where: str, name: str, value, lo: float | None = None, hi: float | None = None,
             *, lo_open: bool = False, hi_open: bool = False) -> float:
    """A finite number in the interval (ints accepted, bools not)."""
    left = "(" if lo_open else "["
    right = ")" if hi_open else "]"
    span = f"in {left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{right}"
    if not is_number(value):
        raise ArgumentTypeError(f"{_prefix(where, name)} must be a number {span}, got "
                                f"{describe(value)}")
    v = float(value)
    bad = (not math.isfinite(v)
           or (lo is not None and (v <= lo if lo_open else v < lo))
           or (hi is not None and (v >= hi if hi_open else v > hi)))
    if bad:
        raise ArgumentError(f"{_prefix(where, name)} must be a finite number {span}, got "
                            f"{describe(value)}")
    return v


def boolean(where: str, name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{_prefix(where, name)} must be True or False, got "
                                f"{describe(value)}")
    return bool(value)


def optional_boolean(where: str, name: str, value) -> bool | None:
    """None (the default applies) or True / False."""
    if value is None:
        return None
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{_prefix(where, name)} must be True, False or None (the "
                                f"model's default), got {describe(value)}")
    return bool(value)


def one_of(where: str, name: str, value, allowed) -> object:
    allowed = tuple(allowed)
    try:
        ok = any(value == a and type(value) is type(a) for a in allowed)
    except Exception:
        ok = False
    if not ok:
        raise ArgumentError(f"{_prefix(where, name)} must be one of {allowed}, got "
                            f"{describe(value)}")
    return value


def token_id(where: str, name: str, value, vocab: int) -> int:
    """One token id in [0, vocab)."""
    return int_in(where, name, value, 0, vocab)


def token_ids(where: str, name: str, values, vocab: int) -> tuple[int, ...]:
    """A sequence of token ids, each an int in [0, vocab)."""
    if isinstance(values, (str, bytes)) or is_int(values):
        raise ArgumentTypeError(f"{_prefix(where, name)} must be a sequence of token ids, got "
                                f"{describe(values)}")
    try:
        items = list(np.asarray(values).reshape(-1).tolist()) if hasattr(values, "shape") else list(values)
    except TypeError:
        raise ArgumentTypeError(f"{_prefix(where, name)} must be a sequence of token ids, got "
                                f"{describe(values)}") from None
    return tuple(token_id(where, f"{name}[{i}]", v, vocab) for i, v in enumerate(items))


def float_dtype(where: str, name: str, dtype):
    """A floating jnp dtype (float32, bfloat16, float16); integer/bool dtypes are refused."""
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise ArgumentTypeError(f"{_prefix(where, name)} must be a floating dtype such as "
                                f"jnp.float32 or jnp.bfloat16, got {describe(dtype)}") from None
    if not jnp.issubdtype(dt, jnp.floating):
        raise ArgumentTypeError(f"{_prefix(where, name)} must be a floating dtype such as "
                                f"jnp.float32 or jnp.bfloat16, got {dt} (weights cast to it "
                                "would be rounded to integers)")
    return dt


def image_token_message(image_token_id: int, ids, name: str = "tokens") -> str | None:
    """The error for image-token ids in a model's input when no vision tower runs them (V4.1
    reserves `image_token_id` for image patches), or None. ids: int array of any shape."""
    if image_token_id is None or image_token_id < 0:
        return None
    hits = np.argwhere(np.asarray(ids) == image_token_id)
    if not hits.size:
        return None
    where = ", ".join(map(str, hits[0].tolist()))
    return (f"{name} hold the image token {image_token_id} (first at index {where}): image "
            f"inputs need the vision tower, which this implementation does not run yet; "
            f"pass text tokens only")
