"""The kernel registry: implementations per op, the choice between them (platform preference,
`use(op, impl)`, `DEEPINFER_KERNELS="op=impl,op=impl"`) and the call through the choice.

A leaf module: implementations register themselves here (`deepinfer_fn.kernels_xla`, the
`custom_calls` package); `deepinfer_fn.kernels` holds the public ops and imports both.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable

import jax


class KernelUnavailable(RuntimeError):
    """The requested kernel implementation does not exist for this build or platform."""


_REGISTRY: dict[str, dict[str, Callable]] = {}
_PREFERENCE = {"gpu": ("mosaic_gpu", "xla"), "cpu": ("xla",), "tpu": ("xla",)}
_OVERRIDES: dict[str, str] = {}


def register(op: str, impl: str):
    """Decorator: `fn` is implementation `impl` of `op`. `fn.opt_in = True` keeps it out of the
    platform preference (only `use` / DEEPINFER_KERNELS choose it); `fn.available()`, when
    present, says whether it can run on this device; `fn.prefers(*args, **kwargs)`, when
    present, whether the platform preference takes it for these arguments (the shapes where it
    was measured faster; otherwise the call goes to the XLA reference). A forced choice runs
    regardless."""
    def deco(fn):
        _REGISTRY.setdefault(op, {})[impl] = fn
        return fn
    return deco


def register_unbuilt(op: str, impl: str, why: str):
    """A dispatch point without an implementation: calling it raises KernelUnavailable(why)."""
    def fn(*args, **kwargs):
        raise KernelUnavailable(f"kernel {op!r} has no {impl!r} implementation in this build: "
                                f"{why}")
    register(op, impl)(fn)


def implementations(op: str) -> tuple[str, ...]:
    """The implementation names registered for `op`, in registration order."""
    return tuple(_REGISTRY.get(op, {}))


def implementation(op: str, impl: str) -> Callable:
    """The function registered as `impl` of `op` (tests, benchmarks: call one directly)."""
    fn = _REGISTRY.get(op, {}).get(impl)
    if fn is None:
        raise KernelUnavailable(f"kernel {op!r} has no implementation {impl!r}; "
                                f"available: {sorted(_REGISTRY.get(op, {}))}")
    return fn


def _env_overrides() -> dict[str, str]:
    spec = os.environ.get("DEEPINFER_KERNELS", "")
    pairs = [p.split("=", 1) for p in spec.split(",") if p.strip()]
    return {k.strip(): v.strip() for k, v in pairs}


def choose(op: str, platform: str | None = None) -> str:
    """The implementation `op` runs with on `platform` (default backend if None)."""
    impls = _REGISTRY.get(op)
    if not impls:
        raise KernelUnavailable(f"unknown kernel op {op!r}; known: {sorted(_REGISTRY)}")
    forced = _OVERRIDES.get(op) or _env_overrides().get(op)
    if forced:
        if forced not in impls:
            raise KernelUnavailable(f"kernel {op!r} has no implementation {forced!r}; "
                                    f"available: {sorted(impls)}")
        return forced
    platform = platform or jax.default_backend()
    for impl in _PREFERENCE.get(platform, ("xla",)):
        fn = impls.get(impl)
        if (fn is not None and not getattr(fn, "opt_in", False)
                and getattr(fn, "available", lambda: True)()):
            return impl
    return "xla"


@contextlib.contextmanager
def use(op: str, impl: str):
    """Force `op` to run with `impl` inside the block (tests, benchmarks)."""
    if impl not in _REGISTRY.get(op, {}):
        raise KernelUnavailable(f"kernel {op!r} has no implementation {impl!r}")
    old = _OVERRIDES.get(op)
    _OVERRIDES[op] = impl
    try:
        yield
    finally:
        if old is None:
            _OVERRIDES.pop(op, None)
        else:
            _OVERRIDES[op] = old


def selection() -> tuple[tuple[str, str], ...]:
    """(op, implementation `choose` picks) for every registered op, sorted: what a compiled
    program's kernel choices depend on besides its arguments (`prefers`)."""
    return tuple((op, choose(op)) for op in sorted(_REGISTRY))


def chosen_for(op: str, *args, **kwargs) -> str:
    """The implementation `call(op, *args, **kwargs)` runs: `choose(op)`, unless that came
    from the platform preference and its `prefers` declines these arguments (then "xla")."""
    impl = choose(op)
    fn = _REGISTRY[op][impl]
    forced = _OVERRIDES.get(op) or _env_overrides().get(op)
    if not forced and not getattr(fn, "prefers", lambda *a, **k: True)(*args, **kwargs):
        return "xla"
    return impl


def call(op: str, *args, **kwargs):
    """`op`'s chosen implementation (`chosen_for`) applied to the arguments."""
    return _REGISTRY[op][chosen_for(op, *args, **kwargs)](*args, **kwargs)
