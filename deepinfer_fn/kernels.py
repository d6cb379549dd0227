"""Kernel registry: one public function per hot op, a pure-XLA reference always present.

The model calls only the public functions here (`grouped_matmul`, `attention`); which
implementation runs is chosen by platform, overridable with `use(op, impl)` or the
environment variable `DEEPINFER_KERNELS="op=impl,op=impl"`. Every implementation is tested
against the XLA reference (tests/test_kernels.py).

Backends:
  xla         pure XLA, every platform (the reference).
  xla_select  pure XLA, opt-in: `top_k_rows` by radix select instead of a sort.
  mosaic_gpu  Pallas Mosaic GPU kernels for NVIDIA Hopper (registered by `custom_calls`).
              Chosen by default on an sm_90 GPU for `grouped_matmul` and `sparse_attention`;
              the others (`mhc_pre`, `mhc_post`, `attention`, `compressor_decode`) are opt-in
              (`fn.opt_in = True`: measured no faster than XLA at decode, and their Mosaic
              lowering costs seconds of compile time per call site): force them with `use` or
              DEEPINFER_KERNELS, e.g. "mhc_pre=mosaic_gpu,mhc_post=mosaic_gpu".
  sm100       NVIDIA Blackwell dispatch point: not built (no SM100 hardware was available).
  ascend      Huawei Ascend dispatch point: needs CANN 9.2, not built.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable

import jax
import jax.numpy as jnp

from deepinfer_fn.model.common import einsum, linear, matmul_precision, operand_dtype, rms_norm
from deepinfer_fn.model.mhc_math import collapse, expand, mhc_weights
from deepinfer_fn.model.rope import apply_rope, rope_cos_sin


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


# ------------------------------------------------------------------ indexer top-k
def top_k_rows(scores, visible, k: int) -> jax.Array:
    """Indices [..., min(k, N)] int32 of the best visible rows (spec §2.7 step 6, §4.5).

    scores [..., N] (any float dtype), visible [..., N] bool. Invisible rows are masked to
    -inf, the k largest taken (total order: -0.0 < +0.0; ties go to the lower row index),
    and selected-but-invisible entries replaced by -1.
    Order: "xla" lists them by decreasing score (lax.top_k); "xla_select" by increasing row
    index, its -1 entries possibly in between. The set of valid indices is the same.
    """
    return call("top_k_rows", scores, visible, k)


@register("top_k_rows", "xla")
def _top_k_rows_xla(scores, visible, k):
    k = min(k, scores.shape[-1])
    masked = jnp.where(visible, scores, -jnp.inf)
    _, idx = jax.lax.top_k(masked, k)
    return jnp.where(jnp.take_along_axis(visible, idx, axis=-1), idx, -1).astype(jnp.int32)


def _sortable_key(x) -> tuple[jax.Array, int]:
    """Float -> (uint32 key, significant bits): keys compare like the floats' total order."""
    if x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        x = x.astype(jnp.float32)
    width = 8 * x.dtype.itemsize
    utype = jnp.uint16 if width == 16 else jnp.uint32
    bits = jax.lax.bitcast_convert_type(x, utype)
    sign = utype(1 << (width - 1))
    key = jnp.where((bits & sign) != 0, ~bits, bits | sign)
    return key.astype(jnp.uint32), width


def _radix_bits(rows: int, n: int) -> int:
    """Digit width of one selection pass: 8 (fewer passes) while the per-pass compare work
    rows * n * 2^bits stays small, else 4."""
    return 8 if rows * n <= 1 << 16 else 4


@register("top_k_rows", "xla_select")
def _top_k_rows_select(scores, visible, k, radix_bits: int | None = None):
    """Radix select on the float bit pattern, no sort. Opt-in (DEEPINFER_KERNELS=
    top_k_rows=xla_select): on an H200 it beat lax.top_k only for one sequence over many
    rows; its ~15-30 small kernels lose to XLA's top-k elsewhere (benchmarks/topk_compressor.py).

    Each pass fixes the next digit of the k-th largest key T: per row, the count of keys
    that match the digits fixed so far and have digit >= j, for every j (one fused
    compare-and-reduce). Then rows with key > T, and the lowest-index `k - #(key > T)` rows
    with key == T, are compacted in index order (one cumsum, one scatter)."""
    n = scores.shape[-1]
    k = min(k, n)
    lead = scores.shape[:-1]
    if k == 0:
        return jnp.zeros(lead + (0,), jnp.int32)
    key, width = _sortable_key(jnp.where(visible, scores, -jnp.inf))
    key = key.reshape(-1, n)
    vis = visible.reshape(-1, n)
    rows = key.shape[0]
    bits = radix_bits or _radix_bits(rows, n)
    prefix = jnp.zeros((rows, 1), jnp.uint32)   # digits of T fixed so far
    above = jnp.zeros((rows, 1), jnp.int32)     # keys above every key with that prefix
    done = 0
    while done < width:
        b = min(bits, width - done)
        shift = width - done - b
        digit = (key >> shift) & jnp.uint32((1 << b) - 1)
        j = jnp.arange(1 << b, dtype=jnp.uint32)
        ge = digit[:, None, :] >= j[None, :, None]                  # [rows, 2^b, n]
        if done:
            ge &= ((key >> (shift + b)) == prefix)[:, None, :]
        counts = jnp.sum(ge, axis=-1, dtype=jnp.int32)             # [rows, 2^b], non-increasing
        d = jnp.sum(above + counts >= k, axis=-1, keepdims=True, dtype=jnp.int32) - 1
        nxt = jnp.take_along_axis(jnp.pad(counts, ((0, 0), (0, 1))), d + 1, axis=-1)
        above = above + nxt
        prefix = (prefix << b) | d.astype(jnp.uint32)
        done += b
    gt, eq = key > prefix, key == prefix
    need = k - above
    incl = jnp.cumsum(jnp.stack([gt, eq]).astype(jnp.int32), axis=-1)
    before_gt, before_eq = incl[0] - gt, incl[1] - eq
    take = (gt | (eq & (before_eq < need))) & vis
    pos = jnp.where(take, before_gt + jnp.minimum(before_eq, need), k)
    out = jnp.full((rows, k), -1, jnp.int32)
    out = out.at[jnp.arange(rows)[:, None], pos].set(
        jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (rows, n)), mode="drop")
    return out.reshape(lead + (k,))


# ------------------------------------------------------------------ mHC (hyper-connections)
def mhc_pre(streams, fn, base, scale, norm_weight, *, iters: int, hc_eps: float,
            norm_eps: float):
    """Input side of one mHC module and the sub-block's RMSNorm (spec §2.3 steps 1-6, §2.2).

    streams [N, n, D]; fn [n*D, (2+n)*n] fp32; base [(2+n)*n]; scale [3]; norm_weight [D].
    Returns h [N, D] = rms_norm(collapse(streams, pre), norm_weight) in streams' dtype,
    post [N, n] fp32 and comb [N, n, n] fp32 (`iters` Sinkhorn iterations).
    """
    n, d = streams.shape[-2:]
    if streams.ndim != 3 or fn.shape != (n * d, (2 + n) * n) or norm_weight.shape != (d,):
        raise ValueError(f"mhc_pre: shapes streams{streams.shape} fn{fn.shape} "
                         f"norm_weight{norm_weight.shape}; want [N, n, D], [n*D, (2+n)*n], [D]")
    return call("mhc_pre", streams, fn, base, scale, norm_weight, iters=iters, hc_eps=hc_eps,
                norm_eps=norm_eps)


@register("mhc_pre", "xla")
def _mhc_pre_xla(streams, fn, base, scale, norm_weight, *, iters, hc_eps, norm_eps):
    pre, post, comb = mhc_weights(streams, fn, base, scale, n=streams.shape[-2], iters=iters,
                                  hc_eps=hc_eps, norm_eps=norm_eps)
    return rms_norm(collapse(streams, pre), norm_weight, norm_eps), post, comb


def mhc_post(streams, y, post, comb) -> jax.Array:
    """Output side of one mHC module: X'_k = post_k y + sum_j comb[j,k] X_j (spec §2.3 step 7).

    streams [N, n, D]; y [N, D]; post [N, n] fp32; comb [N, n, n] fp32 -> [N, n, D] in
    streams' dtype.
    """
    nt, n, d = streams.shape
    if y.shape != (nt, d) or post.shape != (nt, n) or comb.shape != (nt, n, n):
        raise ValueError(f"mhc_post: shapes streams{streams.shape} y{y.shape} post{post.shape} "
                         f"comb{comb.shape}; want [N, n, D], [N, D], [N, n], [N, n, n]")
    return call("mhc_post", streams, y, post, comb)


@register("mhc_post", "xla")
def _mhc_post_xla(streams, y, post, comb):
    return expand(streams, y, post, comb)


for _op in ("mhc_pre", "mhc_post"):
    _unbuilt(_op, "sm100", "no SM100 (Blackwell) hardware was available to build and test it")
    _unbuilt(_op, "ascend", "the Ascend backend needs CANN 9.2, which this build does not include")


# ------------------------------------------------------------------ compressor decode step
def compressor_decode(x, position, params, rings, ratio: int, freqs, eps: float):
    """One new token through the compressors of a layer (spec §2.6, §2.7 step 1, §3.2).

    x [B, D]; position [B] int32, the token's absolute position; params: a tuple of
    compressor parameter dicts (wkv/wgate [D, c*d], ape [m, c*d] fp32, norm [d]; c = 2
    means overlapping windows); rings: a tuple, per compressor, of its ring before this
    token (raw_kv [B, R, c*d], raw_gate [B, R, c*d] fp32; slot = position % R, R >= c*m).
    Returns per compressor (kappa [B, c*d] in raw_kv's dtype, gate + ape [B, c*d] fp32,
    row [B, d] in raw_kv's dtype): the token's ring entries, and the row of its window
    w = position // m pooled from the ring (positions < position) and the token itself
    standing in for the window's later positions -- the exact row when the token closes
    the window -- RMS-normed and rotated at m * w.
    """
    return call("compressor_decode", x, position, params, rings, ratio, freqs, eps)


def compressor_row_finish(p, pooled, position, ratio: int, freqs, eps: float):
    """pooled [B, d] -> RMSNorm (weight p["norm"]) + compress RoPE at m * (position // m)."""
    row = rms_norm(pooled, p["norm"], eps, out_dtype=pooled.dtype)
    cos, sin = rope_cos_sin((position // ratio) * ratio, freqs, row.dtype)
    return apply_rope(row, cos, sin)


@register("compressor_decode", "xla")
def _compressor_decode_xla(x, position, params, rings, ratio, freqs, eps):
    m = ratio
    f32 = jnp.float32
    w0 = position // m
    out = []
    for p, (ring_kv, ring_gate) in zip(params, rings):
        dim, width = p["norm"].shape[0], p["wkv"].shape[1]
        overlap = width == 2 * dim
        kappa = linear(x, p["wkv"]).astype(ring_kv.dtype)
        gate = linear(x, p["wgate"]).astype(f32) + p["ape"].astype(f32)[position % m]
        win = w0[:, None] + jnp.arange(-1 if overlap else 0, 1)       # [B, c] window numbers
        pos = win[..., None] * m + jnp.arange(m)                      # [B, c, m]
        from_ring = (pos < position[:, None, None])[..., None]
        slot = pos % ring_kv.shape[1]
        gather = jax.vmap(lambda r, i: r[i])
        win_kv = jnp.where(from_ring, gather(ring_kv, slot), kappa[:, None, None])
        win_gate = jnp.where(from_ring, gather(ring_gate, slot), gate[:, None, None])
        if overlap:   # A-halves of window w-1 (none before position 0), B-halves of window w
            a_gate = jnp.where((win[:, 0] >= 0)[:, None, None], win_gate[:, 0, :, :dim], -jnp.inf)
            kv = jnp.concatenate([win_kv[:, 0, :, :dim], win_kv[:, 1, :, dim:]], axis=1)
            g = jnp.concatenate([a_gate, win_gate[:, 1, :, dim:]], axis=1)
        else:
            kv, g = win_kv[:, 0], win_gate[:, 0]
        weights = jax.nn.softmax(g, axis=1).astype(kv.dtype)
        pooled = jnp.sum(weights.astype(f32) * kv.astype(f32), axis=1).astype(kv.dtype)
        out.append((kappa, gate, compressor_row_finish(p, pooled, position, m, freqs, eps)))
    return tuple(out)
