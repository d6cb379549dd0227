"""Seeded fuzzing helpers for the API and engine fuzz tests (no Hypothesis: numpy's default_rng).

A case is (label, kwargs, valid): `valid` comes from the test's own oracle (the documented
contract), never from the library. `rejected_at_call` runs a call that must fail and checks
that it raised a ValueError/TypeError before anything was compiled.
"""

from __future__ import annotations

import collections

import numpy as np

import deepinfer_fn as di
from deepinfer_fn.config import ConfigError
from deepinfer_fn.errors import ArgumentError

PROJECT_ERRORS = (ArgumentError, ConfigError, di.CheckpointError)
TALLY = collections.Counter()
"""Per test module: how many rejections raised the project's own types vs a bare ValueError /
TypeError (printed by the tests for the report)."""
BUILTIN = []
"""(function name, repr of the error) of each rejection not raised with a project type."""


def pick(rng: np.random.Generator, options):
    """One element of a sequence, chosen by the seeded generator."""
    return options[int(rng.integers(len(options)))]


def rejected_at_call(fn, *args, **kwargs) -> BaseException:
    """fn(*args, **kwargs) must raise ValueError or TypeError and compile nothing; returns the
    exception. Any other outcome (a return, another exception type) fails the test."""
    with di.ProgramCounter() as counter:
        try:
            result = fn(*args, **kwargs)
        except (ValueError, TypeError) as e:
            err = e
        else:
            raise AssertionError(f"accepted an invalid call: returned {type(result).__name__}")
    assert counter.programs == 0, f"compiled {counter.names} before rejecting: {err!r}"
    assert str(err), f"{type(err).__name__} without a message"
    own = isinstance(err, PROJECT_ERRORS)
    TALLY["project" if own else "builtin"] += 1
    if not own:
        BUILTIN.append((getattr(fn, "__qualname__", repr(fn)), repr(err)[:160]))
    return err
