"""Engram (docs/MODEL.md §V2.7, §7.2): primes, multipliers, the real token map (99,092 keys),
bit-exact hashing against a Python-integer loop, hash invariants (chunked == whole, start ==
pad, the image latch), FP8 row dequantisation and the gate against numpy loops."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deepinfer_fn as di
from deepinfer_fn.model import engram

CFG = di.ModelConfig.preset("v4.1-flash")
CONSTS = engram.HashConstants.from_config(CFG)
hash_jit = jax.jit(engram.hash_ids, static_argnums=3)
gate_jit = jax.jit(engram.gate, static_argnames="eps")
engram_jit = jax.jit(engram.engram, static_argnames="eps")
dequant_jit = jax.jit(engram.dequantize_rows, static_argnums=2)
V, CV, PAD, IMG = CFG.vocab_size, CFG.engram_compressed_vocab_size, 2, CFG.image_token_id


# ------------------------------------------------------------------------------ references
def sieve_primes_above(start: int, count: int) -> list[int]:
    """The `count` smallest primes > start, by a numpy sieve of Eratosthenes."""
    hi = start + 4000
    small = np.ones(int(math.isqrt(hi)) + 1, bool)
    small[:2] = False
    for i in range(2, int(math.isqrt(len(small))) + 1):
        small[i * i::i] = False
    seg = np.ones(hi - start, bool)                      # numbers start+1 .. hi
    for p in np.flatnonzero(small):
        first = ((start + 1 + p - 1) // p) * p
        seg[first - start - 1::p] = False
    primes = [start + 1 + int(i) for i in np.flatnonzero(seg)]
    assert len(primes) >= count
    return primes[:count]


def ref_hash(seq, history, token_map, consts):
    """Python-integer loop: int64 [T, L, C] row ids of seq (list of raw ids) after history."""
    full = list(history) + list(seq)
    H, out = len(history), []
    for t in range(len(seq)):
        c, blocked = [], False
        for s in range(consts.max_ngram):
            w = full[H + t - s]
            blocked = blocked or (consts.image_token_id >= 0 and w == consts.image_token_id)
            c.append(int(token_map[consts.pad_id if blocked else w]))
        layers = []
        for mult, primes, offsets in zip(consts.multipliers, consts.primes, consts.offsets):
            h, cols = c[0] * mult[0], []
            for k in range(1, consts.max_ngram):
                h ^= c[k] * mult[k]
                assert h < 2 ** 63
                for e in range(consts.n_heads):
                    j = (k - 1) * consts.n_heads + e
                    cols.append(h % primes[j] + offsets[j])
            layers.append(cols)
        out.append(layers)
    return np.array(out, np.int64)


def ref_e4m3(byte: int) -> float:
    """FP8 E4M3FN from its bits: sign, 4-bit exponent (bias 7), 3-bit mantissa."""
    sign = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 0xF, byte & 0x7
    if e == 15 and m == 7:
        return math.nan
    return sign * (m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


def ref_dequant(codes, scales):
    out = np.zeros(codes.shape, np.float64)
    for idx in np.ndindex(codes.shape):
        s = int(scales[idx[:-1] + (idx[-1] // 32,)])
        out[idx] = ref_e4m3(int(codes[idx])) * 2.0 ** (s - 127)
    return out


def ref_gate(x, e, wkv, qw, kw, eps, skip):
    """float64 loops over tokens and streams (§2.7 gate steps 2-4)."""
    S, n, D = x.shape
    out = x.astype(np.float64).copy()
    for t in range(S):
        if skip[t]:
            continue
        kv = e[t].astype(np.float64) @ wkv.astype(np.float64)
        v = kv[n * D:]
        for j in range(n):
            xj, kj = x[t, j].astype(np.float64), kv[j * D:(j + 1) * D]
            rx = xj / math.sqrt(np.mean(xj * xj) + eps)
            rk = kj / math.sqrt(np.mean(kj * kj) + eps)
            s = float(np.sum(rx * qw[j] * kw[j] * rk)) / math.sqrt(D)
            g = 1 / (1 + math.exp(-math.copysign(math.sqrt(max(abs(s), 1e-6)), s) if s else 0.0))
            out[t, j] = xj + g * v
    return out


def random_ids(rng, shape, images=True):
    ids = rng.integers(0, V, shape)
    if images:
        ids[rng.random(shape) < 0.08] = IMG
    ids[rng.random(shape) < 0.05] = PAD
    return ids.astype(np.int32)


@pytest.fixture(scope="module")
def random_map():
    return np.random.default_rng(7).integers(0, CV, V).astype(np.int32)


@pytest.fixture(scope="module")
def real_map():
    return engram.load_token_map()


# ------------------------------------------------------------------------------ constants
def test_primes_and_table_rows():
    primes = sieve_primes_above(15_999_999, 48)
    assert CONSTS.primes == (tuple(primes[:24]), tuple(primes[24:]))
    assert (primes[0], primes[23], primes[24], primes[47]) == (16000057, 16000463, 16000477,
                                                               16000889)
    assert CONSTS.rows == (384_006_168, 384_016_682) == CFG.engram_num_embeddings
    for p, off in zip(CONSTS.primes, CONSTS.offsets):
        assert off == tuple(int(v) for v in np.cumsum((0,) + p[:-1]))


def test_multipliers():
    assert CONSTS.multipliers == (
        (76632096046245, 4839876093313, 35959672319349, 73987337458391),
        (67716810739261, 51510806800915, 30921347202721, 82619226485591))
    bound = (2 ** 63 - 1) // 99092 // 2
    for layer, m in zip((1, 14), CONSTS.multipliers):
        draw = np.random.default_rng(10007 * layer).integers(0, bound, size=4, dtype=np.int64)
        assert m == tuple(int(v) * 2 + 1 for v in draw)
        assert all(v % 2 == 1 and (CV - 1) * v < 2 ** 63 for v in m)


# ------------------------------------------------------------------------------ token map
def test_real_token_map(real_map):
    import tokenizers
    from deepinfer_fn import text
    assert real_map.shape == (V,) and real_map.dtype == np.int32
    assert engram.map_size(real_map) == 99_092 == CFG.engram_compressed_vocab_size
    engram.check_token_map(real_map, CONSTS, V)
    first_seen = np.maximum.accumulate(real_map)            # ids numbered in first-seen order
    assert real_map[0] == 0 and np.all(np.diff(first_seen) <= 1) and np.all(real_map <= first_seen)
    tok = tokenizers.Tokenizer.from_file(str(text.default_tokenizer_path()))
    same = lambda *toks: {int(real_map[tok.token_to_id(t)]) for t in toks}
    assert len(same("Hello", "hello", "ĠHello", "Ġhello")) == 1        # case, leading space
    assert len(same("Ċ", "ĊĊ", "Ġ", "ĠĠ", "ĉ")) == 1                   # whitespace -> " "
    assert same("the") != same("Hello") and same("Ġthe") == same("The")
    with pytest.raises(ValueError, match="99091 compressed ids"):
        engram.check_token_map(np.minimum(real_map, 99090), CONSTS, V)


def test_token_map_keys():
    texts = ["A", "a", " a", "é", "e", "\u0301", "\x0b", "x\ufffd", "y\ufffd", "  ", "\t"]
    raw = ["A", "a", "Ġa", "é", "e", "acc", "vt", "a", "raw_y", "ĠĠ", "ĉ"]
    m = engram.token_map_from_strings(texts, raw)
    # "A" "a" " a" share; é -> e; a lone accent / vertical tab normalise to "" and keep their
    # own text; U+FFFD decodes are keyed by the raw token ("a" joins the "a" key)
    assert m.tolist() == [0, 0, 0, 1, 1, 2, 3, 0, 4, 5, 5]


# ------------------------------------------------------------------------------ hashing
def test_hash_matches_integer_reference(random_map):
    rng = np.random.default_rng(0)
    ids, history = random_ids(rng, (2, 24)), random_ids(rng, (2, 3))
    got = np.asarray(hash_jit(jnp.asarray(ids), jnp.asarray(history), jnp.asarray(random_map),
                              CONSTS))
    assert got.shape == (2, 24, 2, 24) and got.dtype == np.int32
    host = engram.hash_ids_host(ids, history, random_map, CONSTS)
    for b in range(2):
        want = ref_hash(ids[b], history[b], random_map, CONSTS)
        np.testing.assert_array_equal(got[b], want)
        np.testing.assert_array_equal(host[b], want)
    lo = np.asarray(CONSTS.offsets)                           # [L, C]
    assert np.all(got >= lo) and np.all(got < lo + np.asarray(CONSTS.primes))


def test_hash_of_real_text(real_map):
    from deepinfer_fn import text
    ids = text.load_tokenizer().encode("def engram(x):\n    return x  # N-GRAM memory\n")[:24]
    ids = np.asarray((ids + [PAD] * 24)[:24], np.int32)[None]
    h0 = engram.initial_history(1, CONSTS)
    got = np.asarray(hash_jit(jnp.asarray(ids), h0, jnp.asarray(real_map), CONSTS))
    np.testing.assert_array_equal(got[0], ref_hash(ids[0], [PAD] * 3, real_map, CONSTS))


def test_chunked_ragged_equals_whole(random_map):
    """Chunks of 5 (each row taking its own number of tokens per chunk, the rest junk) with
    the history carried between chunks give the whole-sequence ids, images included."""
    rng = np.random.default_rng(1)
    whole = random_ids(rng, (2, 24))
    tmap = jnp.asarray(random_map)
    want = np.asarray(hash_jit(jnp.asarray(whole), engram.initial_history(2, CONSTS), tmap,
                               CONSTS))
    history, pos, got = engram.initial_history(2, CONSTS), [0, 0], [[], []]
    takes = [(5, 3), (2, 5), (5, 0), (5, 5), (5, 4), (2, 5), (0, 2)]
    for take in takes:
        chunk = random_ids(rng, (2, 5))
        for b in range(2):
            chunk[b, :take[b]] = whole[b, pos[b]:pos[b] + take[b]]
        out = np.asarray(hash_jit(jnp.asarray(chunk), history, tmap, CONSTS))
        for b in range(2):
            got[b].append(out[b, :take[b]])
            pos[b] += take[b]
        history = engram.advance_history(history, jnp.asarray(chunk), jnp.asarray(take, jnp.int32))
    assert pos == [24, 24]
    for b in range(2):
        np.testing.assert_array_equal(np.concatenate(got[b]), want[b])
        np.testing.assert_array_equal(np.asarray(history)[b], whole[b, -3:])


def test_sequence_start_hashes_as_pad(random_map):
    rng = np.random.default_rng(2)
    ids = random_ids(rng, (1, 21), images=False)
    junk = random_ids(rng, (1, 3))
    tmap = jnp.asarray(random_map)
    fresh = hash_jit(jnp.asarray(np.concatenate([ids, junk], 1)),
                     engram.initial_history(1, CONSTS), tmap, CONSTS)
    padded = hash_jit(jnp.asarray(np.concatenate([np.full((1, 3), PAD, np.int32), ids], 1)),
                      jnp.asarray(junk), tmap, CONSTS)
    np.testing.assert_array_equal(np.asarray(fresh)[:, :21], np.asarray(padded)[:, 3:])


def test_image_blocks_exactly_three_positions_after_it(random_map):
    rng = np.random.default_rng(3)
    tmap, h0 = jnp.asarray(random_map), engram.initial_history(3, CONSTS)
    base = random_ids(rng, (24,), images=False)
    base[base == IMG] = 7
    p = 10
    with_img, other_prefix, no_img = base.copy(), base.copy(), base.copy()
    with_img[p] = other_prefix[p] = IMG
    other_prefix[:p] = random_ids(rng, (p,), images=False)
    no_img[p] = 5
    out = np.asarray(hash_jit(jnp.asarray(np.stack([with_img, other_prefix, no_img])), h0, tmap,
                              CONSTS))
    np.testing.assert_array_equal(out[0, p:], out[1, p:])       # latch: nothing before p counts
    np.testing.assert_array_equal(out[0, p + 4:], out[2, p + 4:])  # 4-grams ending past p+3
    nh = CONSTS.n_heads
    for k in range(4):                     # at p+k the n-grams of size n > k hold the image
        for n in (2, 3, 4):
            cols = slice((n - 2) * nh, (n - 1) * nh)
            a, b = out[0, p + k, :, cols], out[2, p + k, :, cols]
            assert np.all(a != b) if n > k else np.array_equal(a, b), (k, n)
    # the image row and the three after it hash as if everything up to p were pad
    pads = np.asarray(ref_hash([PAD] * (p + 1) + list(with_img[p + 1:]), [PAD] * 3, random_map,
                               CONSTS))
    np.testing.assert_array_equal(out[0, p:], pads[p:])


def test_advance_history_keeps_rows_without_tokens():
    h = jnp.asarray([[1, 2, 3], [4, 5, 6]], jnp.int32)
    ids = jnp.asarray([[7, 8, 9, 10], [11, 12, 13, 14]], jnp.int32)
    out = engram.advance_history(h, ids, jnp.asarray([0, 2], jnp.int32))
    assert np.asarray(out).tolist() == [[1, 2, 3], [6, 11, 12]]


# ------------------------------------------------------------------------------ lookup, gate
def test_dequantize_rows_is_exact():
    codes = np.array([b for b in range(256) if b not in (0x7F, 0xFF)] * 4, np.uint8)
    codes = np.random.default_rng(4).permutation(codes)[:1000].reshape(5, 200)
    scales = np.random.default_rng(5).integers(100, 150, (5, 7)).astype(np.uint8)
    scales[0, 0] = 127
    want = ref_dequant(codes, scales)
    got = np.asarray(dequant_jit(jnp.asarray(codes), jnp.asarray(scales), jnp.float32))
    np.testing.assert_array_equal(got, want.astype(np.float32))
    assert np.array_equal(want.astype(np.float32), want)            # exact in float32 too
    as_fp8 = jax.lax.bitcast_convert_type(jnp.asarray(codes), jnp.float8_e4m3fn)
    np.testing.assert_array_equal(
        np.asarray(dequant_jit(as_fp8, jnp.asarray(scales), jnp.float32)), got)
    bf16 = np.asarray(dequant_jit(jnp.asarray(codes), jnp.asarray(scales),
                                  jnp.bfloat16)).astype(np.float32)
    np.testing.assert_array_equal(bf16, got)                        # e4m3 * 2^k fits bf16


def test_gate_matches_reference():
    rng = np.random.default_rng(6)
    S, n, D, E = 6, 4, 64, 96
    x = rng.standard_normal((S, n, D)).astype(np.float32)
    e = rng.standard_normal((S, E)).astype(np.float32)
    wkv = (rng.standard_normal((E, (n + 1) * D)) / math.sqrt(E)).astype(np.float32)
    qw, kw = (1 + 0.3 * rng.standard_normal((2, n, D))).astype(np.float32)
    skip = np.array([False, True, False, False, True, False])
    got = np.asarray(gate_jit(jnp.asarray(x), jnp.asarray(e), jnp.asarray(wkv),
                                 jnp.asarray(qw), jnp.asarray(kw), eps=1e-20,
                                 skip=jnp.asarray(skip)))
    want = ref_gate(x, e, wkv, qw, kw, 1e-20, skip)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(got[skip], x[skip])


def test_engram_layer_end_to_end_on_tiny():
    """tiny's layer-2 Engram: ids -> hash ids -> table rows -> gate, against the loops."""
    cfg = di.ModelConfig.preset("v4.1-tiny")
    consts = engram.HashConstants.from_config(cfg)
    params = di.init_params(cfg, jax.random.key(1))
    w = params["layers"][2]["engram"]
    tmap = np.arange(cfg.vocab_size, dtype=np.int32)            # identity: 256 keys
    engram.check_token_map(tmap, consts, cfg.vocab_size)
    rng = np.random.default_rng(8)
    ids = rng.integers(0, cfg.vocab_size, (1, 9)).astype(np.int32)
    ids[0, 4] = cfg.image_token_id
    rows = hash_jit(jnp.asarray(ids), engram.initial_history(1, consts), jnp.asarray(tmap), consts)
    x = rng.standard_normal((9, cfg.hc_mult, cfg.hidden_size)).astype(np.float32)
    skip = ids[0] == cfg.image_token_id
    got = np.asarray(engram_jit(w, jnp.asarray(x), rows[0, :, 1], eps=cfg.rms_norm_eps,
                                   skip=jnp.asarray(skip)))
    ref_rows = ref_hash(ids[0], [cfg.engram_pad_token_id] * 3, tmap, consts)[:, 1]   # [T, C]
    table, scale = np.asarray(w["table"]), np.asarray(w["table_scale"])
    e = ref_dequant(table[ref_rows], scale[ref_rows]).reshape(9, -1)
    want = ref_gate(x, e, np.asarray(w["wkv"]), np.asarray(w["q_weight"]),
                    np.asarray(w["k_weight"]), cfg.rms_norm_eps, skip)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[4], x[4])
    assert not np.allclose(got[5], x[5])
