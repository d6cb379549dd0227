"""Tests for deepinfer_fn.checkpoint.quant against independent bit-level / element-loop oracles.

Round-trip bound checked element-wise (x = w / scale, half an ulp of the target format at x):
  FP8 E4M3: |deq - w| <= scale * 2**(max(floor(log2|x|), -6) - 4)
            (=> <= 2**-4 |w| for |x| >= 2**-6, <= 2**-10 * scale below)
  FP4 E2M1: |deq - w| <= scale * 2**(max(floor(log2|x|), 0) - 2)
            (=> <= 2**-2 |w| for |x| >= 1, <= 2**-2 * scale below)
plus: every block's amax/scale lies in (fmt_max/2, fmt_max] (scale exponent rounded up, minimal).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from deepinfer_fn.checkpoint import quant as Q

E8M0 = ml_dtypes.float8_e8m0fnu
E4M3 = ml_dtypes.float8_e4m3fn


# ----------------------------------------------------------------- independent scalar oracles


def e2m1_oracle(code: int) -> float:
    """Bit-level E2M1: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0."""
    sign = -1.0 if (code >> 3) & 1 else 1.0
    e = (code >> 1) & 0b11
    m = code & 1
    if e == 0:  # subnormal: 2**(1 - bias) * (m / 2)
        return sign * (m / 2.0)
    return sign * (2.0 ** (e - 1)) * (1.0 + m / 2.0)


def e4m3fn_oracle(byte: int) -> float:
    """Bit-level E4M3FN: sign bit 7, exponent bits 6..3 (bias 7), mantissa bits 2..0; S.1111.111 = NaN."""
    sign = -1.0 if (byte >> 7) & 1 else 1.0
    e = (byte >> 3) & 0xF
    m = byte & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    if e == 0:
        return sign * 2.0 ** (1 - 7) * (m / 8.0)
    return sign * 2.0 ** (e - 7) * (1.0 + m / 8.0)


def ue8m0_oracle(byte: int) -> float:
    return math.nan if byte == 255 else math.ldexp(1.0, byte - 127)


def fp8_loop_oracle(qbytes, sbytes, b0, b1):
    o, i = qbytes.shape
    out = np.empty((o, i), np.float64)
    for r in range(o):
        for c in range(i):
            out[r, c] = e4m3fn_oracle(int(qbytes[r, c])) * ue8m0_oracle(int(sbytes[r // b0, c // b1]))
    return out


def fp4_loop_oracle(packed, sbytes, group):
    o, half = packed.shape
    out = np.empty((o, 2 * half), np.float64)
    for r in range(o):
        for c in range(2 * half):
            byte = int(packed[r, c // 2]) & 0xFF
            code = byte & 0xF if c % 2 == 0 else byte >> 4
            out[r, c] = e2m1_oracle(code) * ue8m0_oracle(int(sbytes[r, c // group]))
    return out


def _bits_equal(a, b):
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


# ----------------------------------------------------------------- format facts


def test_e2m1_table_matches_bit_oracle_all_codes():
    oracle = np.array([e2m1_oracle(c) for c in range(16)], np.float32)
    assert _bits_equal(Q.E2M1_VALUES, oracle)  # includes code 8 == -0.0 (sign bit)
    assert np.signbit(Q.E2M1_VALUES[8]) and Q.E2M1_VALUES[8] == 0
    assert list(Q.E2M1_VALUES[:8]) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]  # spec §5.3 table


def test_e4m3fn_ml_dtypes_matches_spec():
    vals = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float64)
    oracle = np.array([e4m3fn_oracle(b) for b in range(256)])
    assert np.array_equal(np.isnan(vals), np.isnan(oracle))
    assert np.array_equal(vals[~np.isnan(vals)], oracle[~np.isnan(oracle)])
    assert not np.any(np.isinf(vals))  # no infinities
    assert np.nanmax(vals) == 448.0 == float(ml_dtypes.finfo(E4M3).max) == Q.E4M3_MAX
    assert np.isnan(vals).sum() == 2  # only 0x7F and 0xFF
    # overflow never produces inf
    assert not np.isinf(np.array([1e6, -1e6, np.inf], np.float32).astype(E4M3).astype(np.float32)).any()


def test_ue8m0_to_float_all_bytes_and_nan_check():
    raw = np.arange(256, dtype=np.uint8)
    oracle = np.array([ue8m0_oracle(b) for b in range(256)], np.float64)
    for inp in (raw, raw.view(E8M0)):
        got = Q.ue8m0_to_float(inp, check=False)
        assert got.dtype == np.float32
        assert np.isnan(got[255]) and np.array_equal(got[:255].astype(np.float64), oracle[:255])
    with pytest.raises(ValueError, match="NaN"):
        Q.ue8m0_to_float(raw)
    assert Q.ue8m0_to_float(raw[:255]).shape == (255,)  # no NaN: fine with check
    with pytest.raises(TypeError):
        Q.ue8m0_to_float(np.ones(3, np.float32))


def test_float_to_ue8m0_rounds_exponent_up():
    x = np.array([1.0, 1.5, 2.0, 3.0, 0.75, 0.5, 2.0**-100 * 1.0000001, 2.0**127, 448.0, 0.0])
    got = Q.float_to_ue8m0(x)
    assert got.dtype == E8M0
    want = [0, 1, 1, 2, 0, -1, -99, 127, 9, -127]
    assert list(got.view(np.uint8).astype(int) - 127) == want
    v = got.astype(np.float64)
    assert np.all(v >= x) and np.all(v[x > 0] / 2 < x[x > 0])  # minimal power of two >= x
    # floor for zero / very tiny values
    assert Q.float_to_ue8m0(np.array([0.0, 1e-45]), min_exponent=-20).astype(np.float64).tolist() == [
        2.0**-20,
        2.0**-20,
    ]
    for bad in ([-1.0], [np.nan], [np.inf], [2.0**127 * 1.5]):
        with pytest.raises(ValueError):
            Q.float_to_ue8m0(np.array(bad))


# ----------------------------------------------------------------- FP8 dequant vs element loop


def _rand_fp8(rng, o, i, nblk, lo=100, hi=150):
    qbytes = rng.integers(0, 256, size=(o, i), dtype=np.uint8)
    qbytes[(qbytes & 0x7F) == 0x7F] = 0x3C  # avoid the two NaN encodings
    sbytes = rng.integers(lo, hi, size=nblk, dtype=np.uint8)
    return qbytes, sbytes


@pytest.mark.parametrize("shape,block", [((200, 300), (128, 128)), ((70, 100), (32, 32)), ((33, 64), (32, 16))])
def test_dequantize_fp8_block_vs_loop(shape, block):
    rng = np.random.default_rng(0)
    o, i = shape
    nblk = (-(-o // block[0]), -(-i // block[1]))
    qbytes, sbytes = _rand_fp8(rng, o, i, nblk)
    want = fp8_loop_oracle(qbytes, sbytes, *block)
    got = Q.dequantize_fp8_block(qbytes.view(E4M3), sbytes.view(E8M0), block=block)
    assert got.dtype == np.float32 and got.shape == shape
    assert np.array_equal(got.astype(np.float64), want)
    # raw uint8 inputs, float32 scales and a non-contiguous (transposed) q give the same result
    assert _bits_equal(Q.dequantize_fp8_block(qbytes, sbytes, block=block), got)
    assert _bits_equal(Q.dequantize_fp8_block(qbytes.view(E4M3), Q.ue8m0_to_float(sbytes), block=block), got)
    qt = np.ascontiguousarray(qbytes.T).view(E4M3).T  # F-ordered view with same values
    assert not qt.flags.c_contiguous
    assert _bits_equal(Q.dequantize_fp8_block(qt, sbytes.view(E8M0), block=block), got)


def test_dequantize_fp8_errors():
    q = np.zeros((200, 300), E4M3)
    s = np.full((2, 3), 127, np.uint8).view(E8M0)
    with pytest.raises(ValueError, match=r"\(2, 2\).*\(200, 300\)"):
        Q.dequantize_fp8_block(q, s[:, :2])
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(200, 300\)"):
        Q.dequantize_fp8_block(q, s, block=(32, 32))
    with pytest.raises(TypeError):
        Q.dequantize_fp8_block(q.astype(np.float32), s)
    with pytest.raises(TypeError):
        Q.dequantize_fp8_block(q.view(np.int8), s)
    with pytest.raises(TypeError):
        Q.dequantize_fp8_block(q, s.view(np.uint8).astype(np.int32))
    nan_s = s.view(np.uint8).copy()
    nan_s[1, 2] = 255
    with pytest.raises(ValueError, match="NaN"):
        Q.dequantize_fp8_block(q, nan_s.view(E8M0))


# ----------------------------------------------------------------- FP4 dequant vs element loop


@pytest.mark.parametrize("shape,group", [((5, 128), 32), ((7, 80), 32), ((3, 24), 8)])
def test_dequantize_fp4_vs_loop(shape, group):
    rng = np.random.default_rng(1)
    o, i = shape
    packed = rng.integers(-128, 128, size=(o, i // 2), dtype=np.int8)
    sbytes = rng.integers(110, 140, size=(o, -(-i // group)), dtype=np.uint8)
    want = fp4_loop_oracle(packed, sbytes, group)
    got = Q.dequantize_fp4(packed, sbytes.view(E8M0), group=group)
    assert got.dtype == np.float32 and got.shape == shape
    assert np.array_equal(got.astype(np.float64), want)
    assert _bits_equal(Q.dequantize_fp4(packed.view(np.uint8), sbytes, group=group), got)


def test_fp4_nibble_order():
    # byte 0x72: low nibble 2 -> column 0 = 1.0, high nibble 7 -> column 1 = 6.0
    packed = np.array([[0x72, -0x80 + 0x09]], np.int8).reshape(1, 2)  # second byte 0x89: -0.5, -0
    got = Q.dequantize_fp4(packed, np.array([[2.0]], np.float32), group=32)
    assert got.tolist() == [[2.0, 12.0, -1.0, -0.0]]


def test_dequantize_fp4_errors():
    p = np.zeros((4, 64), np.int8)
    with pytest.raises(ValueError, match=r"\(4, 2\).*\(4, 64\)"):
        Q.dequantize_fp4(p, np.full((4, 2), 127, np.uint8))
    with pytest.raises(TypeError):
        Q.dequantize_fp4(p.astype(np.int16), np.full((4, 4), 127, np.uint8))
    bad = np.full((4, 4), 127, np.uint8)
    bad[3, 3] = 255
    with pytest.raises(ValueError, match="NaN"):
        Q.dequantize_fp4(p, bad)
    with pytest.raises(ValueError, match="even"):
        Q.quantize_fp4(np.ones((4, 63), np.float32))
    with pytest.raises(TypeError):
        Q.quantize_fp4(np.ones((4, 64), np.int32))
    with pytest.raises(ValueError, match="NaN or infinite"):
        Q.quantize_fp8_block(np.full((4, 64), np.inf, np.float32))


# ----------------------------------------------------------------- round trips


def _weights(rng, kind, shape):
    if kind == "normal":
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)
    if kind == "heavy":  # student-t(1.5) with a few huge outliers and zero rows/blocks
        w = (rng.standard_t(1.5, size=shape) * 1e-3).astype(np.float32)
        w.flat[rng.integers(0, w.size, 5)] = rng.choice([-3e4, 5e3, 1e-30, -7.0], 5)
        w[:3] = 0.0
        w[-1, :40] = 1e-38  # tiny (near float32 subnormal) block contents
        return w
    raise AssertionError(kind)


def _half_ulp(x, emin, mbits):
    """Half an ulp of a format with min normal exponent emin and mbits mantissa bits, at x."""
    a = np.abs(x.astype(np.float64))
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    e = np.maximum(e, emin)
    return np.exp2(e - mbits - 1)


def _expand(s, b0, b1, o, i):
    return np.repeat(np.repeat(s, b0, 0), b1, 1)[:o, :i]


def _check_pow2(s_e8m0):
    v = s_e8m0.astype(np.float64)
    m, _ = np.frexp(v)
    assert np.all(m == 0.5) and np.all(np.isfinite(v))


@pytest.mark.parametrize("kind", ["normal", "heavy"])
@pytest.mark.parametrize("shape,block", [((200, 300), (128, 128)), ((70, 100), (32, 32))])
def test_fp8_round_trip_bound(kind, shape, block):
    rng = np.random.default_rng(2)
    w = _weights(rng, kind, shape)
    q, s = Q.quantize_fp8_block(w, block=block)
    assert q.dtype == E4M3 and q.shape == shape
    assert s.dtype == E8M0 and s.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    _check_pow2(s)
    deq = Q.dequantize_fp8_block(q, s, block=block).astype(np.float64)
    sf = _expand(s.astype(np.float64), *block, *shape)
    x = w.astype(np.float64) / sf
    err = np.abs(deq - w.astype(np.float64))
    assert np.all(err <= sf * _half_ulp(x, -6, 3))
    assert np.all(err <= np.maximum(2.0**-4 * np.abs(w), 2.0**-10 * sf))
    # q itself never exceeds the format and the scale is the minimal power of two
    assert np.all(np.abs(q.astype(np.float32)) <= 448)
    ratio = Q._block_amax(np.abs(w), *block).astype(np.float64) / s.astype(np.float64)
    floor = s.view(np.uint8) == 0  # scale 2**-127: all-zero blocks, or amax/448 <= 2**-127
    assert np.all(floor[ratio == 0])
    assert np.all(ratio <= 448) and np.all(ratio[~floor] > 224)
    # RNE cast agrees with ml_dtypes' own float32 -> e4m3fn cast of w / scale (exact division)
    assert np.array_equal(q.view(np.uint8), (w / sf.astype(np.float32)).astype(E4M3).view(np.uint8))


@pytest.mark.parametrize("kind", ["normal", "heavy"])
@pytest.mark.parametrize("shape,group", [((64, 256), 32), ((9, 80), 32)])
def test_fp4_round_trip_bound(kind, shape, group):
    rng = np.random.default_rng(3)
    w = _weights(rng, kind, shape)
    p, s = Q.quantize_fp4(w, group=group)
    assert p.dtype == np.int8 and p.shape == (shape[0], shape[1] // 2)
    assert s.dtype == E8M0 and s.shape == (shape[0], -(-shape[1] // group))
    _check_pow2(s)
    deq = Q.dequantize_fp4(p, s, group=group).astype(np.float64)
    sf = _expand(s.astype(np.float64), 1, group, *shape)
    x = w.astype(np.float64) / sf
    err = np.abs(deq - w.astype(np.float64))
    assert np.all(err <= sf * _half_ulp(x, 0, 1))
    assert np.all(err <= np.maximum(2.0**-2 * np.abs(w), 2.0**-2 * sf))
    ratio = Q._block_amax(np.abs(w), 1, group).astype(np.float64) / s.astype(np.float64)
    floor = s.view(np.uint8) == 0  # scale 2**-127: all-zero groups, or amax/6 <= 2**-127
    assert np.all(floor[ratio == 0]) and (floor.any() == (kind == "heavy")) and not floor.all()
    assert np.all(ratio <= 6) and np.all(ratio[~floor] > 3)
    # independent nearest-value oracle: brute-force distance to all 8 magnitudes (ties: any)
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    d = np.abs(np.abs(x)[..., None] - grid)
    best = d.min(-1)
    assert np.all(np.abs(np.abs(deq / sf) - np.abs(x)) == best)
    # codes equal ml_dtypes' own RNE float32 -> float4_e2m1fn cast (low nibble of its byte)
    codes = (w / sf.astype(np.float32)).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    pu = p.view(np.uint8)
    assert np.array_equal(pu & 0xF, codes[:, 0::2]) and np.array_equal(pu >> 4, codes[:, 1::2])


def test_fp4_ties_to_even():
    # group scale 1 (amax 6); ties go to the even code (mantissa bit 0)
    row = np.array([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -5, -0.1, 0.26, 4.99], np.float32)
    w = np.zeros((1, 32), np.float32)
    w[0, : row.size] = row
    p, s = Q.quantize_fp4(w)
    assert s.astype(np.float32).item() == 1.0
    deq = Q.dequantize_fp4(p, s)[0, : row.size]
    assert deq.tolist() == [6, 0, 1, 1, 2, 2, 4, 4, -0.0, -1, -4, -0.0, 0.5, 4]
    assert np.signbit(deq[8]) and np.signbit(deq[11])  # negative -> code 8 (-0)


def test_fp8_ties_to_even():
    w = np.zeros((1, 128), np.float32)
    w[0, :5] = [448, 1.0625, 1.1875, -1.0625, 2.0**-10]  # scale 1; 2**-10 is the subnormal tie 0 | 2**-9
    q, s = Q.quantize_fp8_block(w)
    assert s.astype(np.float32).item() == 1.0
    assert Q.dequantize_fp8_block(q, s)[0, :5].tolist() == [448, 1.0, 1.25, -1.0, 0.0]


def test_round_trip_exact_for_representable_values():
    rng = np.random.default_rng(4)
    # FP8: random finite e4m3 codes times random block scales
    qbytes, sbytes = _rand_fp8(rng, 200, 300, (2, 3), lo=90, hi=160)
    w = Q.dequantize_fp8_block(qbytes, sbytes)
    q2, s2 = Q.quantize_fp8_block(w)
    assert _bits_equal(Q.dequantize_fp8_block(q2, s2), w)
    # blocks whose max |q| is in (224, 448] reproduce the very same codes and scales
    qbytes[0, 0] = qbytes[0, 200] = qbytes[150, 0] = qbytes[150, 200] = 0x7E  # 448
    w = Q.dequantize_fp8_block(qbytes, sbytes)
    q2, s2 = Q.quantize_fp8_block(w)
    assert np.array_equal(s2.view(np.uint8), sbytes)
    zero = qbytes.view(E4M3).astype(np.float32) == 0  # +-0 may come back with either sign only if 0
    assert np.array_equal(q2.view(np.uint8)[~zero], qbytes[~zero])
    # FP4: random codes times random group scales
    packed = rng.integers(-128, 128, size=(16, 64), dtype=np.int8)
    gs = rng.integers(100, 150, size=(16, 4), dtype=np.uint8)
    w4 = Q.dequantize_fp4(packed, gs)
    p2, s4 = Q.quantize_fp4(w4)
    assert _bits_equal(Q.dequantize_fp4(p2, s4), w4)


def test_vectorized_speed_smoke():
    # 4096 x 4096 round trip: guards against accidental per-block Python loops
    rng = np.random.default_rng(5)
    w = rng.standard_normal((1024, 4096), dtype=np.float32)
    q, s = Q.quantize_fp8_block(w)
    assert Q.dequantize_fp8_block(q, s).shape == w.shape
    p, s4 = Q.quantize_fp4(w)
    assert Q.dequantize_fp4(p, s4).shape == w.shape


# ----------------------------------------------------------------- JAX versions


def test_jax_versions_match_numpy():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    rng = np.random.default_rng(6)
    for shape, block in (((200, 300), (128, 128)), ((70, 100), (32, 32))):
        nblk = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
        qbytes, sbytes = _rand_fp8(rng, *shape, nblk)  # normal-range scales (XLA may flush subnormals)
        want = Q.dequantize_fp8_block(qbytes, sbytes, block=block)
        f = jax.jit(Q.dequantize_fp8_block_jax, static_argnames="block")
        got = f(jnp.asarray(qbytes.view(E4M3)), jnp.asarray(sbytes.view(E8M0)), block=block)
        assert got.dtype == jnp.float32 and _bits_equal(np.asarray(got), want)
        assert _bits_equal(np.asarray(f(qbytes, sbytes, block=block)), want)  # raw uint8 inputs
    for shape, group in (((5, 128), 32), ((7, 80), 32)):
        packed = rng.integers(-128, 128, size=(shape[0], shape[1] // 2), dtype=np.int8)
        sbytes = rng.integers(110, 140, size=(shape[0], -(-shape[1] // group)), dtype=np.uint8)
        want = Q.dequantize_fp4(packed, sbytes, group=group)
        g = jax.jit(Q.dequantize_fp4_jax, static_argnames="group")
        got = g(jnp.asarray(packed), jnp.asarray(sbytes.view(E8M0)), group=group)
        assert got.dtype == jnp.float32 and _bits_equal(np.asarray(got), want)
        assert _bits_equal(np.asarray(g(packed.view(np.uint8), sbytes, group=group)), want)
    with pytest.raises(ValueError, match=r"\(2, 2\).*\(200, 300\)"):
        Q.dequantize_fp8_block_jax(np.zeros((200, 300), E4M3), np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match=r"\(5, 3\).*\(5, 64\)"):
        Q.dequantize_fp4_jax(np.zeros((5, 64), np.int8), np.zeros((5, 3), np.float32))
    with pytest.raises(TypeError):
        Q.dequantize_fp4_jax(np.zeros((5, 64), np.int16), np.zeros((5, 4), np.float32))
