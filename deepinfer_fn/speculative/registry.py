"""Speculative method names -> drafters (`speculative.drafter.Drafter`).

`generate(..., speculative=name)`, `stream_generate` and `Engine(speculative=name)` look the
name up here; nothing else branches on it. A new drafter is one module defining a `Drafter`,
plus its line below (or `register(drafter)` at run time, e.g. from a test). "dspark" serves
V4 drafters and V4.1 checkpoint drafters (`dspark_select`).
"""

from __future__ import annotations

from deepinfer_fn.errors import ArgumentError
from deepinfer_fn.speculative import dspark_select, mtp
from deepinfer_fn.speculative.drafter import Drafter

_DRAFTERS: dict[str, Drafter] = {"mtp": mtp.DRAFTER, "dspark": dspark_select.DRAFTER}
_BUILT_IN = frozenset(_DRAFTERS)


def names() -> tuple[str, ...]:
    """The registered method names, in registration order."""
    return tuple(_DRAFTERS)


def get(name: str) -> Drafter:
    """The drafter registered as `name` (ArgumentError naming the known ones otherwise)."""
    if isinstance(name, str) and name in _DRAFTERS:
        return _DRAFTERS[name]
    raise ArgumentError(f"speculative={name!r}: expected one of {names()}")


def register(drafter: Drafter) -> None:
    """Adds `drafter` under its name (a name already taken is an error)."""
    if not isinstance(drafter, Drafter):
        raise TypeError(f"register needs a speculative.drafter.Drafter, got "
                        f"{type(drafter).__name__}")
    if drafter.name in _DRAFTERS:
        raise ValueError(f"a drafter named {drafter.name!r} is already registered")
    _DRAFTERS[drafter.name] = drafter


def unregister(name: str) -> None:
    """Removes a drafter added with `register` (the built-in ones stay)."""
    if name in _BUILT_IN:
        raise ValueError(f"the built-in drafter {name!r} cannot be removed")
    _DRAFTERS.pop(name, None)
