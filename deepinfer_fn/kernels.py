"""Kernel registry: one public function per hot op, a pure-XLA reference always present.

The model calls only the public functions here (`grouped_matmul`, `attention`); which
implementation runs is chosen by platform, overridable with `use(op, impl)` or the
environment variable `DEEPINFER_KERNELS="op=impl,op=impl"`. Every implementation is tested
against the XLA reference (tests/test_kernels.py).

Backends:
  xla         pure XLA, every platform (the reference).
  mosaic_gpu  Pallas Mosaic GPU kernels for NVIDIA Hopper (registered by `custom_calls`).
  sm100       NVIDIA Blackwell dispatch point: not built (no SM100 hardware was available).
  ascend      Huawei Ascend dispatch point: needs CANN 9.2, not built.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable

import jax
import jax.numpy as jnp

from deepinfer_fn.model.common import einsum, matmul_precision, operand_dtype


class KernelUnavailable(RuntimeError):
    """The requested kernel implementation does not exist for this build or platform."""


_REGISTRY: dict[str, dict[str, Callable]] = {}
_PREFERENCE = {"gpu": ("mosaic_gpu", "xla"), "cpu": ("xla",), "tpu": ("xla",)}
_OVERRIDES: dict[str, str] = {}


def register(op: str, impl: str):
    def deco(fn):
        _REGISTRY.setdefault(op, {})[impl] = fn
        return fn
    return deco


def _unbuilt(op: str, impl: str, why: str):
    def fn(*args, **kwargs):
        raise KernelUnavailable(f"kernel {op!r} has no {impl!r} implementation in this build: {why}")
    register(op, impl)(fn)


def implementations(op: str) -> tuple[str, ...]:
    return tuple(_REGISTRY.get(op, {}))


def _env_overrides() -> dict[str, str]:
    spec = os.environ.get("DEEPINFER_KERNELS", "")
    pairs = [p.split("=", 1) for p in spec.split(",") if p.strip()]
    return {k.strip(): v.strip() for k, v in pairs}


def choose(op: str, platform: str | None = None) -> str:
    """The implementation `op` runs with on `platform` (default backend if None)."""
    _ensure_custom_calls_loaded()
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
        if impl in impls and getattr(impls[impl], "available", lambda: True)():
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


def call(op: str, *args, **kwargs):
    _ensure_custom_calls_loaded()
    return _REGISTRY[op][choose(op)](*args, **kwargs)


_CUSTOM_LOADED = False


def _ensure_custom_calls_loaded():
    global _CUSTOM_LOADED
    if not _CUSTOM_LOADED:
        _CUSTOM_LOADED = True
        try:
            import custom_calls  # noqa: F401  registers GPU implementations when importable
        except ImportError:
            pass


# ------------------------------------------------------------------ grouped matmul (MoE GEMM)
def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Rows of x [M, K] sorted by group; w [G, K, N]; group_sizes [G] int32 -> [M, N].

    Row block g (group_sizes[g] rows) is multiplied by w[g]. Rows past sum(group_sizes)
    are zero. fp32 accumulation, result in w's dtype.
    """
    return call("grouped_matmul", x, w, group_sizes)


@register("grouped_matmul", "xla")
def _grouped_matmul_xla(x, w, group_sizes):
    fed = operand_dtype(w.dtype)
    y = jax.lax.ragged_dot(x.astype(w.dtype).astype(fed), w.astype(fed), group_sizes.astype(jnp.int32),
                           precision=matmul_precision(w.dtype),
                           preferred_element_type=jnp.float32)
    return y.astype(w.dtype)


# ------------------------------------------------------------------ attention
def attention(q, keys, bias, sinks) -> jax.Array:
    """Single-KV-head attention with a sink logit (spec §2.8).

    q [B, T, H, d]; keys [B, S, d] (K = V); bias [B, T, S] additive fp32 mask (0 or -inf);
    sinks [H] fp32. Returns o [B, T, H, d] = softmax([q.k/sqrt(d) + bias, sink]) @ keys,
    the sink's probability dropped. Logits and softmax in fp32.
    """
    return call("attention", q, keys, bias, sinks)


@register("attention", "xla")
def _attention_xla(q, keys, bias, sinks):
    d = q.shape[-1]
    dtype = keys.dtype
    logits = einsum("bthd,bsd->bhts", q, keys, out_dtype=jnp.float32, dtype=dtype)
    logits = logits / jnp.sqrt(jnp.float32(d))
    logits = logits + bias[:, None, :, :]
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None, None], logits.shape[:-1] + (1,))
    full = jnp.concatenate([logits, sink], axis=-1)
    probs = jax.nn.softmax(full, axis=-1)[..., :-1]
    return einsum("bhts,bsd->bthd", probs, keys, out_dtype=dtype, dtype=dtype)


# ------------------------------------------------------------------ sparse (decode) attention
def sparse_attention(q, window_kv, window_bias, rows, row_idx, sinks) -> jax.Array:
    """Attention of S new tokens over window keys plus selected compressed rows (spec §2.8).

    q [B,S,H,d]; window_kv [B,Wk,d] (ring slots and/or the chunk's own keys, K = V);
    window_bias [B,S,Wk] fp32 additive (0 or -inf); rows [B,N,d] compressed rows;
    row_idx [B,S,K] int32 indices into rows, -1 = no row (masked); sinks [H] fp32.
    One softmax over [window logits, row logits, sink]; the sink's value is zero.
    Returns o [B,S,H,d] in rows' dtype. Logits and softmax in fp32.
    """
    return call("sparse_attention", q, window_kv, window_bias, rows, row_idx, sinks)


@register("sparse_attention", "xla")
def _sparse_attention_xla(q, window_kv, window_bias, rows, row_idx, sinks):
    d = q.shape[-1]
    dtype = window_kv.dtype
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    gathered = jnp.take_along_axis(rows[:, None], jnp.maximum(row_idx, 0)[..., None], axis=2)
    logits_w = einsum("bshd,bwd->bhsw", q, window_kv, out_dtype=jnp.float32, dtype=dtype) * scale
    logits_w = logits_w + window_bias[:, None]
    logits_r = einsum("bshd,bskd->bhsk", q, gathered, out_dtype=jnp.float32, dtype=dtype) * scale
    logits_r = jnp.where((row_idx >= 0)[:, None], logits_r, -jnp.inf)
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None, None], logits_w.shape[:-1] + (1,))
    probs = jax.nn.softmax(jnp.concatenate([logits_w, logits_r, sink], axis=-1), axis=-1)
    wk = window_kv.shape[1]
    out = einsum("bhsw,bwd->bshd", probs[..., :wk], window_kv, out_dtype=jnp.float32, dtype=dtype)
    out = out + einsum("bhsk,bskd->bshd", probs[..., wk:-1], gathered, out_dtype=jnp.float32,
                       dtype=dtype)
    return out.astype(dtype)


for _op in ("grouped_matmul", "attention", "sparse_attention"):
    _unbuilt(_op, "sm100", "no SM100 (Blackwell) hardware was available to build and test it")
    _unbuilt(_op, "ascend", "the Ascend backend needs CANN 9.2, which this build does not include")
