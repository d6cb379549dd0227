"""Shared helpers for the Mosaic GPU kernels: device detection and interpret mode."""

from __future__ import annotations

import contextlib
import functools
import inspect

import jax


@functools.lru_cache(maxsize=1)
def on_hopper() -> bool:
    """True only when the default backend is an NVIDIA GPU of compute capability 9.0."""
    try:
        if jax.default_backend() != "gpu":
            return False
        dev = jax.devices()[0]
        if "nvidia" not in str(getattr(dev, "device_kind", "")).lower():
            return False
        cc = getattr(dev, "compute_capability", None)
        return cc is not None and str(cc).split(".")[0] == "9"
    except Exception:  # noqa: BLE001 - no usable backend means "not available"
        return False


def interpret_available() -> bool:
    """Whether Pallas' Mosaic GPU interpret mode (runs kernels on CPU) exists in this JAX."""
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu
        return hasattr(plgpu, "force_gpu_interpret_mode") and hasattr(plgpu, "InterpretGPUParams")
    except ImportError:
        return False


@contextlib.contextmanager
def maybe_interpret(interpret: bool):
    """Trace the Pallas kernels inside under the GPU interpret mode when `interpret`."""
    if not interpret:
        yield
        return
    from jax.experimental.pallas import mosaic_gpu as plgpu
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        yield


def lowered_once(kernel_call, *static_argnames: str):
    """`kernel_call` (builds and calls one Pallas kernel) as a jitted callee of its static
    parameters plus `interpret` (the call is traced under the interpret mode when it is set).
    JAX lowers a jitted callee once per program, so the layers' call sites of one shape share
    one Mosaic lowering instead of lowering the kernel again at every site. A kernel_call
    with an `interpret` parameter of its own receives it too."""
    passes = "interpret" in inspect.signature(kernel_call).parameters

    def call(*args, interpret: bool = False, **static):
        if passes:
            static["interpret"] = interpret
        with maybe_interpret(interpret):
            return kernel_call(*args, **static)
    call.__name__ = call.__qualname__ = kernel_call.__name__    # the program's callee name
    return jax.jit(call, static_argnames=("interpret",) + tuple(static_argnames))


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m
