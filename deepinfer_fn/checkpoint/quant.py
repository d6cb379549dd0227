"""Codec for the DeepSeek-V4 checkpoint weight formats (docs/MODEL.md §5.3).

Formats
-------
* **UE8M0 scale** byte ``b``: value ``2**(b - 127)``; ``b = 255`` is NaN. Stored as
  ``ml_dtypes.float8_e8m0fnu`` (safetensors ``F8_E8M0``); raw ``uint8`` bytes are accepted too.
* **FP8 block-scaled** dense weight: ``q`` E4M3FN ``[o, i]`` plus scale
  ``[ceil(o/b0), ceil(i/b1)]``; ``W[r, c] = q[r, c] * scale[r // b0, c // b1]``.
  V4-Flash uses ``block=(128, 128)``, V4.1 uses ``(32, 32)``.
* **FP4 (E2M1) group-scaled** routed-expert weight: ``packed`` int8 ``[o, i/2]`` — byte ``j``
  of a row holds logical column ``2j`` in its LOW nibble and ``2j+1`` in its HIGH nibble —
  plus UE8M0 scale ``[o, ceil(i/group)]`` (``group = 32``);
  ``W[r, c] = e2m1(code[r, c]) * scale[r, c // group]``.

All numpy functions are vectorized (no Python loop over elements, blocks or groups) and
compute in float32. Every product ``e4m3 * 2**k`` / ``e2m1 * 2**k`` is exact in float32 (and
in bf16) as long as it stays in the normal range, so the dequantizers are exact.

Quantizer conventions (the inverse direction)
---------------------------------------------
* Input weights are first converted to float32 (exact for bf16/f16/f32 inputs; float64
  inputs are rounded to float32 once). Non-finite weights raise ``ValueError``.
* Per block / group: ``scale = 2**ceil(log2(amax / fmt_max))`` (``fmt_max`` = 448 for E4M3,
  6 for E2M1), computed exactly (frexp, no floating log2), so that
  ``fmt_max/2 < amax/scale <= fmt_max`` for every block whose ideal scale is inside the
  UE8M0 range. All-zero blocks (and blocks so tiny that ``amax/fmt_max <= 2**-127``) get the
  floor scale ``2**-127`` (UE8M0 byte 0); their codes are then exactly representable anyway.
* Codes are round-to-nearest, ties-to-even (IEEE) of ``w / scale`` (exact division by a power
  of two). For E2M1 that means ties go to the code with mantissa bit 0:
  0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4 (and symmetric for negatives). The sign is
  kept, so negative values that round to zero become code 8 (−0), like an IEEE cast.
* Round-trip bound (what tests/test_quant.py checks element-wise): with ``x = w / scale``,
  ``|dequant - w| <= scale * ulp(x) / 2`` where
  ``ulp_e4m3(x) = 2**(max(floor(log2|x|), -6) - 3)`` and
  ``ulp_e2m1(x) = 2**(max(floor(log2|x|), 0) - 1)``. Hence for FP8
  ``|err| <= 2**-4 * |w|`` for ``|x| >= 2**-6`` and ``|err| <= 2**-10 * scale`` below that;
  for FP4 ``|err| <= 2**-2 * |w|`` for ``|x| >= 1`` and ``|err| <= 2**-2 * scale`` below.

Errors: wrong dtypes raise ``TypeError``; wrong shapes (message names both shapes), odd FP4
column counts, NaN scales and non-finite weights raise ``ValueError``.

The optional JAX versions (``dequantize_fp8_block_jax``, ``dequantize_fp4_jax``) do the same
math with ``jax.numpy``, are traceable under ``jit`` (block/group must be static Python ints),
and do NOT check for NaN scales (NaN propagates). Note that XLA may flush float32 subnormals
to zero, so they agree with the numpy versions only while scales and products stay in the
normal float32 range (true for real checkpoints).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

__all__ = [
    "E4M3_MAX",
    "E2M1_MAX",
    "E2M1_VALUES",
    "UE8M0_MIN_EXPONENT",
    "UE8M0_MAX_EXPONENT",
    "ue8m0_to_float",
    "float_to_ue8m0",
    "dequantize_fp8_block",
    "quantize_fp8_block",
    "dequantize_fp4",
    "quantize_fp4",
    "dequantize_fp8_block_jax",
    "dequantize_fp4_jax",
]

E4M3_MAX = 448.0
E2M1_MAX = 6.0
UE8M0_MIN_EXPONENT = -127  # byte 0
UE8M0_MAX_EXPONENT = 127  # byte 254 (255 is NaN)

_E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)

# Nibble code -> E2M1 value. Codes 0-7 positive, 8-15 the negatives (8 = -0.0).
_E2M1_POS = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
E2M1_VALUES = np.concatenate([_E2M1_POS, -_E2M1_POS]).astype(np.float32)
E2M1_VALUES.setflags(write=False)

# Byte -> (value of low nibble, value of high nibble): one gather decodes a packed byte.
_FP4_PAIR_LUT = np.stack(
    [E2M1_VALUES[np.arange(256) & 0xF], E2M1_VALUES[np.arange(256) >> 4]], axis=-1
).astype(np.float32)
_FP4_PAIR_LUT.setflags(write=False)

# Midpoints between consecutive non-negative E2M1 values, and whether a tie at that
# midpoint goes UP (the upper neighbour has an even code, i.e. mantissa bit 0).
_E2M1_MIDPOINTS = (0.5 * (_E2M1_POS[:-1] + _E2M1_POS[1:])).astype(np.float32)
_E2M1_TIE_UP = (np.arange(1, 8) % 2) == 0


# --------------------------------------------------------------------------- helpers


def _block2(block: Any, name: str = "block") -> tuple[int, int]:
    try:
        b0, b1 = (int(b) for b in block)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a pair of positive ints, got {block!r}") from None
    if b0 <= 0 or b1 <= 0:
        raise ValueError(f"{name} must be a pair of positive ints, got {block!r}")
    return b0, b1


def _positive_int(v: Any, name: str) -> int:
    if isinstance(v, bool) or int(v) != v or int(v) <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _require_2d(a: np.ndarray, name: str) -> None:
    if a.ndim != 2:
        raise ValueError(f"{name} must be 2-D, got shape {a.shape}")


def _scale_to_f32(scale: Any, *, check: bool = True, name: str = "scale") -> np.ndarray:
    """UE8M0 (e8m0 / raw uint8) or float scale -> float32 values."""
    s = np.asarray(scale)
    if s.dtype == _E8M0 or s.dtype == np.uint8:
        return ue8m0_to_float(s, check=check)
    if s.dtype in (np.float32, np.float64, np.float16) or s.dtype == np.dtype(ml_dtypes.bfloat16):
        out = s.astype(np.float32)
        if check and not np.all(np.isfinite(out)):
            raise ValueError(f"{name} contains NaN or infinite values")
        return out
    raise TypeError(
        f"{name} must be float8_e8m0fnu, uint8 (raw UE8M0 bytes) or a float dtype, got {s.dtype}"
    )


def _scale_blocks_inplace(a: np.ndarray, s: np.ndarray, b0: int, b1: int, divide: bool) -> None:
    """a[r, c] (*= or /=) s[r // b0, c // b1], in place, without materializing a full-size scale.

    ``a`` must be C-contiguous float32 [o, i]; ``s`` is float32 [ceil(o/b0), ceil(i/b1)].
    """
    assert a.flags.c_contiguous and a.dtype == np.float32
    o, i = a.shape
    if o == 0 or i == 0:
        return
    s_rows = np.repeat(s, b0, axis=0)[:o] if b0 > 1 else s  # [o, ceil(i/b1)], small
    op = np.divide if divide else np.multiply
    nfull = i // b1
    if nfull:
        main = a[:, : nfull * b1].reshape(o, nfull, b1)  # always a view (splits last axis)
        op(main, s_rows[:, :nfull, None], out=main)
    if i % b1:
        tail = a[:, nfull * b1 :]
        op(tail, s_rows[:, nfull : nfull + 1], out=tail)


def _block_amax(absw: np.ndarray, b0: int, b1: int) -> np.ndarray:
    """max over each (b0, b1) block of a non-negative [o, i] array (partial edge blocks ok)."""
    o, i = absw.shape
    m = np.maximum.reduceat(absw, np.arange(0, o, b0), axis=0) if b0 > 1 else absw
    return np.maximum.reduceat(m, np.arange(0, i, b1), axis=1) if b1 > 1 else m


def _weights_f32(w: Any, name: str = "w") -> np.ndarray:
    a = np.asarray(w)
    if not (np.issubdtype(a.dtype, np.floating) or a.dtype == np.dtype(ml_dtypes.bfloat16)):
        raise TypeError(f"{name} must be a floating-point array, got dtype {a.dtype}")
    _require_2d(a, name)
    out = np.array(a, dtype=np.float32, order="C", copy=True)
    if not np.all(np.isfinite(out)):
        raise ValueError(f"{name} contains NaN or infinite values (cannot be quantized)")
    return out


# --------------------------------------------------------------------------- UE8M0


def ue8m0_to_float(scale: Any, check: bool = True) -> np.ndarray:
    """UE8M0 scales -> float32 values ``2**(b - 127)``.

    ``scale``: ``float8_e8m0fnu`` array, or ``uint8`` raw bytes. Byte 255 decodes to NaN; with
    ``check=True`` (default) any NaN raises ``ValueError``.
    """
    s = np.asarray(scale)
    if s.dtype == np.uint8:
        s = s.view(_E8M0)
    elif s.dtype != _E8M0:
        raise TypeError(f"UE8M0 scale must be float8_e8m0fnu or uint8 raw bytes, got {s.dtype}")
    out = s.astype(np.float32)
    if check:
        bad = s.view(np.uint8) == 255
        if np.any(bad):
            first = tuple(int(k) for k in np.argwhere(bad)[0])
            raise ValueError(
                f"UE8M0 scale contains NaN (byte 0xFF) at {int(bad.sum())} position(s), "
                f"first at index {first}"
            )
    return out


def float_to_ue8m0(x: Any, *, min_exponent: int = UE8M0_MIN_EXPONENT) -> np.ndarray:
    """Smallest power of two ``>= x`` as ``float8_e8m0fnu`` (exponent rounded UP, exactly).

    ``x`` are non-negative scale magnitudes (typically ``amax / fmt_max``). Values
    ``<= 2**min_exponent`` (including 0, i.e. all-zero blocks) get the floor
    ``2**min_exponent`` (default ``2**-127``, byte 0). Negative, NaN, infinite or
    ``> 2**127`` inputs raise ``ValueError``.
    """
    if not UE8M0_MIN_EXPONENT <= int(min_exponent) <= UE8M0_MAX_EXPONENT:
        raise ValueError(f"min_exponent must be in [-127, 127], got {min_exponent}")
    v = np.asarray(x)
    if v.dtype == _E8M0 or not (
        np.issubdtype(v.dtype, np.floating)
        or np.issubdtype(v.dtype, np.integer)
        or v.dtype == np.dtype(ml_dtypes.bfloat16)
    ):
        raise TypeError(f"float_to_ue8m0 expects a real numeric array, got dtype {v.dtype}")
    v = v.astype(np.float64)
    if not np.all(np.isfinite(v)):
        raise ValueError("float_to_ue8m0: input contains NaN or infinite values")
    if np.any(v < 0):
        raise ValueError("float_to_ue8m0: input contains negative values")
    mant, ex = np.frexp(v)  # v = mant * 2**ex, mant in [0.5, 1) (0 for v == 0)
    k = np.where(mant == 0.5, ex - 1, ex).astype(np.int64)  # ceil(log2(v)), exact
    k = np.where(v == 0, min_exponent, np.maximum(k, min_exponent))
    if np.any(k > UE8M0_MAX_EXPONENT):
        raise ValueError(
            f"float_to_ue8m0: value {float(v.max())!r} needs a scale above 2**127 (not representable)"
        )
    return (k + 127).astype(np.uint8).view(_E8M0)


# --------------------------------------------------------------------------- FP8 (E4M3)


def dequantize_fp8_block(q: Any, scale: Any, block: tuple[int, int] = (128, 128)) -> np.ndarray:
    """E4M3FN ``q [o, i]`` times block scale ``[ceil(o/b0), ceil(i/b1)]`` -> float32 ``[o, i]``.

    ``q``: ``float8_e4m3fn`` (or ``uint8`` raw E4M3 bits). ``scale``: ``float8_e8m0fnu``,
    ``uint8`` raw UE8M0 bytes, or float values. NaN scales raise ``ValueError``.
    """
    b0, b1 = _block2(block)
    qa = np.asarray(q)
    if qa.dtype == np.uint8:
        qa = qa.view(_E4M3)
    elif qa.dtype != _E4M3:
        raise TypeError(f"FP8 weight must be float8_e4m3fn (or uint8 raw bits), got {qa.dtype}")
    _require_2d(qa, "FP8 weight")
    o, i = qa.shape
    s = _scale_to_f32(scale)
    want = (_ceil_div(o, b0), _ceil_div(i, b1))
    if s.shape != want:
        raise ValueError(
            f"FP8 scale shape {s.shape} does not match weight shape {qa.shape} with block "
            f"{(b0, b1)}: expected scale shape {want}"
        )
    out = qa.astype(np.float32, order="C")
    _scale_blocks_inplace(out, s, b0, b1, divide=False)
    return out


def quantize_fp8_block(
    w: Any, block: tuple[int, int] = (128, 128)
) -> tuple[np.ndarray, np.ndarray]:
    """float ``w [o, i]`` -> (``float8_e4m3fn [o, i]``, ``float8_e8m0fnu [ceil(o/b0), ceil(i/b1)]``).

    Per block: ``scale = 2**ceil(log2(amax / 448))`` (floor ``2**-127`` for all-zero blocks),
    ``q = RNE_e4m3(w / scale)``, so ``|q| <= 448`` and ``amax / scale`` is in ``(224, 448]``.
    """
    b0, b1 = _block2(block)
    x = _weights_f32(w)
    o, i = x.shape
    nb = (_ceil_div(o, b0), _ceil_div(i, b1))
    if x.size == 0:
        return x.astype(_E4M3), float_to_ue8m0(np.zeros(nb))
    amax = _block_amax(np.abs(x), b0, b1).astype(np.float64)
    scale = float_to_ue8m0(amax / E4M3_MAX)
    _scale_blocks_inplace(x, scale.astype(np.float32), b0, b1, divide=True)  # exact
    return x.astype(_E4M3), scale


# --------------------------------------------------------------------------- FP4 (E2M1)


def _packed_u8(packed: Any) -> np.ndarray:
    p = np.asarray(packed)
    if p.dtype == np.int8:
        p = p.view(np.uint8)
    elif p.dtype != np.uint8:
        raise TypeError(f"FP4 packed weight must be int8 or uint8, got {p.dtype}")
    _require_2d(p, "FP4 packed weight")
    return p


def dequantize_fp4(packed: Any, scale: Any, group: int = 32) -> np.ndarray:
    """Packed E2M1 ``[o, i/2]`` (int8/uint8) times group scale ``[o, ceil(i/group)]`` -> float32 ``[o, i]``.

    Byte ``j`` of a row holds logical column ``2j`` (low nibble) and ``2j+1`` (high nibble).
    ``scale``: ``float8_e8m0fnu``, ``uint8`` raw UE8M0 bytes, or float values.
    """
    group = _positive_int(group, "group")
    p = _packed_u8(packed)
    o, half = p.shape
    i = 2 * half
    s = _scale_to_f32(scale)
    want = (o, _ceil_div(i, group))
    if s.shape != want:
        raise ValueError(
            f"FP4 scale shape {s.shape} does not match packed weight shape {p.shape} "
            f"(logical [{o}, {i}]) with group {group}: expected scale shape {want}"
        )
    out = _FP4_PAIR_LUT[p].reshape(o, i)  # fresh C-contiguous float32
    _scale_blocks_inplace(out, s, 1, group, divide=False)
    return out


def _e2m1_codes(x: np.ndarray) -> np.ndarray:
    """Nearest E2M1 code (ties to even, sign kept) for float32 ``|x| <= 6``; uint8 codes 0..15."""
    a = np.abs(x)
    # number of midpoints strictly below |x| = index of the nearest value when not on a tie
    mag = np.searchsorted(_E2M1_MIDPOINTS, a, side="left").astype(np.uint8)
    # exact ties: go up when the upper neighbour has an even code
    idx = np.minimum(mag, len(_E2M1_MIDPOINTS) - 1)
    mag += ((a == _E2M1_MIDPOINTS[idx]) & _E2M1_TIE_UP[idx]).astype(np.uint8)
    return mag | (np.signbit(x).astype(np.uint8) << 3)


def quantize_fp4(w: Any, group: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """float ``w [o, i]`` (i even) -> (int8 packed ``[o, i/2]``, ``float8_e8m0fnu [o, ceil(i/group)]``).

    Per (row, group): ``scale = 2**ceil(log2(amax / 6))`` (floor ``2**-127`` for all-zero
    groups); codes are round-to-nearest-even E2M1 of ``w / scale``; column ``2j`` goes to the low
    nibble and ``2j+1`` to the high nibble of byte ``j``.
    """
    group = _positive_int(group, "group")
    x = _weights_f32(w)
    o, i = x.shape
    if i % 2:
        raise ValueError(f"FP4 quantization needs an even number of columns, got shape {x.shape}")
    ng = _ceil_div(i, group)
    if x.size == 0:
        return np.zeros((o, i // 2), np.int8), float_to_ue8m0(np.zeros((o, ng)))
    amax = _block_amax(np.abs(x), 1, group).astype(np.float64)
    scale = float_to_ue8m0(amax / E2M1_MAX)
    _scale_blocks_inplace(x, scale.astype(np.float32), 1, group, divide=True)  # exact
    codes = _e2m1_codes(x)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(np.int8), scale


# --------------------------------------------------------------------------- JAX versions


def _jax_scale_f32(scale: Any):  # -> jax.Array float32
    import jax
    import jax.numpy as jnp

    s = jnp.asarray(scale)
    if s.dtype == jnp.uint8:
        s = jax.lax.bitcast_convert_type(s, jnp.float8_e8m0fnu)
    elif s.dtype != jnp.float8_e8m0fnu and not jnp.issubdtype(s.dtype, jnp.floating):
        raise TypeError(
            f"scale must be float8_e8m0fnu, uint8 (raw UE8M0 bytes) or a float dtype, got {s.dtype}"
        )
    return s.astype(jnp.float32)


def _jax_expand(s, b0: int, b1: int, o: int, i: int):
    import jax.numpy as jnp

    n0, n1 = s.shape
    full = jnp.broadcast_to(s[:, None, :, None], (n0, b0, n1, b1)).reshape(n0 * b0, n1 * b1)
    return full[:o, :i]


def dequantize_fp8_block_jax(q: Any, scale: Any, block: tuple[int, int] = (128, 128)):
    """``jax.numpy`` version of :func:`dequantize_fp8_block` (float32 ``[o, i]``; no NaN check)."""
    import jax
    import jax.numpy as jnp

    b0, b1 = _block2(block)
    qa = jnp.asarray(q)
    if qa.dtype == jnp.uint8:
        qa = jax.lax.bitcast_convert_type(qa, jnp.float8_e4m3fn)
    elif qa.dtype != jnp.float8_e4m3fn:
        raise TypeError(f"FP8 weight must be float8_e4m3fn (or uint8 raw bits), got {qa.dtype}")
    if qa.ndim != 2:
        raise ValueError(f"FP8 weight must be 2-D, got shape {qa.shape}")
    o, i = qa.shape
    s = _jax_scale_f32(scale)
    want = (_ceil_div(o, b0), _ceil_div(i, b1))
    if tuple(s.shape) != want:
        raise ValueError(
            f"FP8 scale shape {tuple(s.shape)} does not match weight shape {tuple(qa.shape)} with "
            f"block {(b0, b1)}: expected scale shape {want}"
        )
    return qa.astype(jnp.float32) * _jax_expand(s, b0, b1, o, i)


def dequantize_fp4_jax(packed: Any, scale: Any, group: int = 32):
    """``jax.numpy`` version of :func:`dequantize_fp4` (float32 ``[o, i]``; no NaN check)."""
    import jax
    import jax.numpy as jnp

    group = _positive_int(group, "group")
    p = jnp.asarray(packed)
    if p.dtype == jnp.int8:
        p = jax.lax.bitcast_convert_type(p, jnp.uint8)
    elif p.dtype != jnp.uint8:
        raise TypeError(f"FP4 packed weight must be int8 or uint8, got {p.dtype}")
    if p.ndim != 2:
        raise ValueError(f"FP4 packed weight must be 2-D, got shape {p.shape}")
    o, half = p.shape
    i = 2 * half
    s = _jax_scale_f32(scale)
    want = (o, _ceil_div(i, group))
    if tuple(s.shape) != want:
        raise ValueError(
            f"FP4 scale shape {tuple(s.shape)} does not match packed weight shape {tuple(p.shape)} "
            f"(logical [{o}, {i}]) with group {group}: expected scale shape {want}"
        )
    codes = jnp.stack([p & 0xF, p >> 4], axis=-1).reshape(o, i)
    vals = jnp.asarray(E2M1_VALUES)[codes.astype(jnp.int32)]
    return vals * _jax_expand(s, 1, group, o, i)
