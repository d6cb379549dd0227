"""The error types of the public API: every bad argument raises one of these at the call.

`ArgumentError` (a ValueError) names the argument, the value and what is allowed;
`ArgumentTypeError` (also a TypeError) is the same for a value of the wrong kind. Files and
configs have their own: `config.ConfigError` (config.json fields), `CheckpointError`
(checkpoint files), `structured.ConstraintError` (grammars and schemas). All are ValueErrors.
"""

from __future__ import annotations


class ArgumentError(ValueError):
    """An argument of a public function is out of range or inconsistent with another."""


class ArgumentTypeError(ArgumentError, TypeError):
    """An argument of a public function has the wrong kind (e.g. a bool where a count is
    meant, a float where a token id is)."""
