"""XLA implementations of the kernel ops (`deepinfer_fn.kernels`): the reference every other
implementation is tested against ("xla", every platform), and `top_k_rows_select` /
`top_k_mask_select` ("xla_select": a radix select instead of a sort). Each registers itself
in `kernel_registry`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_fn.kernel_registry import call, register
from deepinfer_fn.model.common import (einsum, head_rms, linear, matmul_precision, operand_dtype,
                                      rms_norm, swiglu)
from deepinfer_fn.model.mhc_math import collapse, expand, mhc_weights
from deepinfer_fn.model import mhc_math
from deepinfer_fn.model.rope import apply_rope, rope_cos_sin


@register("grouped_matmul", "xla")
def grouped_matmul(x, w, group_sizes):
    """`kernels.grouped_matmul` in XLA: `lax.ragged_dot`, fp32 accumulation."""
    fed = operand_dtype(w.dtype)
    y = jax.lax.ragged_dot(x.astype(w.dtype).astype(fed), w.astype(fed), group_sizes.astype(jnp.int32),
                           precision=matmul_precision(w.dtype),
                           preferred_element_type=jnp.float32)
    return y.astype(w.dtype)


@register("grouped_swiglu", "xla")
def grouped_swiglu(x, w1, w3, group_sizes, *, limit: float):
    """`kernels.grouped_swiglu` unfused: two `grouped_matmul` ops (each through the registry:
    the chosen grouped GEMM) and the SwiGLU in XLA."""
    return swiglu(call("grouped_matmul", x, w1, group_sizes),
                  call("grouped_matmul", x, w3, group_sizes), limit)


@register("attention", "xla")
def attention(q, keys, bias, sinks):
    """`kernels.attention` in XLA: dense logits, one softmax with the sink column."""
    d = q.shape[-1]
    dtype = keys.dtype
    logits = einsum("bthd,bsd->bhts", q, keys, out_dtype=jnp.float32, dtype=dtype)
    logits = logits / jnp.sqrt(jnp.float32(d))
    logits = logits + bias[:, None, :, :]
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None, None], logits.shape[:-1] + (1,))
    full = jnp.concatenate([logits, sink], axis=-1)
    probs = jax.nn.softmax(full, axis=-1)[..., :-1]
    return einsum("bhts,bsd->bthd", probs, keys, out_dtype=dtype, dtype=dtype)


@register("index_scores", "xla")
def index_scores(q_index, head_weights, index_rows):
    """`kernels.index_scores` in XLA. The dots take their operands in the rows' dtype with
    fp32 accumulation (bf16 products are exact in fp32: the same values as an fp32 product
    of the bf16 inputs, on the tensor cores); the head sum is a reduction over the minor
    axis of [B, T, N, H_I]."""
    d = q_index.shape[-1]
    dots = einsum("bthd,bnd->btnh", q_index, index_rows, out_dtype=jnp.float32,
                  dtype=index_rows.dtype)
    return (jax.nn.relu(dots) * head_weights[:, :, None, :]).sum(-1) * d ** -0.5


@register("sparse_attention", "xla")
def sparse_attention(q, window_kv, window_bias, rows, row_idx, sinks):
    """`kernels.sparse_attention` in XLA: gathered rows, one softmax over window, rows, sink."""
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


def _chunk_key_positions(start, n_new, ring_pos, s: int, key_floor=None):
    """Key positions of the window sources, -1 where a key must never be visible: ring slots
    holding a position at or past the chunk's start (stale or rolled back), the chunk's
    padding tokens and keys below key_floor [B] (optional). Returns (chunk positions [B,S],
    ring key positions [B,R], chunk key positions [B,S])."""
    positions = start[:, None] + jnp.arange(s, dtype=jnp.int32)
    floor = jnp.zeros_like(start) if key_floor is None else key_floor
    ring = jnp.where((ring_pos >= floor[:, None]) & (ring_pos >= 0)
                     & (ring_pos < start[:, None]), ring_pos, -1)
    chunk = jnp.where((jnp.arange(s)[None] < n_new[:, None]) & (positions >= floor[:, None]),
                      positions, -1)
    return positions, ring, chunk


def _window_ok(q_pos, k_pos, window: int):
    """Key position s is visible to query t iff t - window < s <= t and s >= 0 (bool)."""
    t, s = q_pos[..., :, None], k_pos[..., None, :]
    return (s <= t) & (s > t - window) & (s >= 0)


def _extra_logits(q, extra_keys, extra_bias, dtype):
    """fp32 logits [B,S,H,K] of the extra keys (shared [B,N,d] or per token [B,S,K,d])."""
    spec = "bshd,bnd->bshn" if extra_keys.ndim == 3 else "bshd,bskd->bshk"
    scale = 1.0 / jnp.sqrt(jnp.float32(q.shape[-1]))
    logits = einsum(spec, q, extra_keys, out_dtype=jnp.float32, dtype=dtype) * scale
    return logits + extra_bias.astype(jnp.float32)[:, :, None, :]


def _extra_values(probs, extra_keys, dtype):
    """probs [B,S,H,K] fp32 times the extra keys -> [B,S,H,d] fp32."""
    spec = "bshn,bnd->bshd" if extra_keys.ndim == 3 else "bshk,bskd->bshd"
    return einsum(spec, probs, extra_keys, out_dtype=jnp.float32, dtype=dtype)


def prepared_query(q, q_norm_eps=None, q_rope=None):
    """The attention query of `kernels.chunk_attention`: q head-normalised (`head_rms`) when
    q_norm_eps is given, then rotated by q_rope = (cos, sin) [B,S,r/2] when given."""
    if q_norm_eps is not None:
        q = head_rms(q, q_norm_eps)
    if q_rope is not None:
        cos, sin = q_rope
        q = apply_rope(q, cos[:, :, None], sin[:, :, None])
    return q


@register("chunk_attention", "xla_dense")
def chunk_attention_dense(q, kv, start, n_new, ring_kv, ring_pos, sinks, *, window,
                          extra_keys=None, extra_bias=None, key_floor=None, q_norm_eps=None,
                          q_rope=None):
    """`kernels.chunk_attention` with dense logits over every ring slot and chunk key (the
    formula as written; S x (R + S) logits). Opt-in: the oracle of the blocked "xla"."""
    q = prepared_query(q, q_norm_eps, q_rope)
    dtype = kv.dtype
    s = q.shape[1]
    positions, ring, chunk = _chunk_key_positions(start, n_new, ring_pos, s, key_floor)
    keys = jnp.concatenate([ring_kv.astype(dtype), kv], axis=1)
    ok = _window_ok(positions, jnp.concatenate([ring, chunk], axis=1), window)
    scale = 1.0 / jnp.sqrt(jnp.float32(q.shape[-1]))
    logits = einsum("bshd,bkd->bshk", q, keys, out_dtype=jnp.float32, dtype=dtype) * scale
    parts = [jnp.where(ok[:, :, None, :], logits, -jnp.inf)]
    if extra_keys is not None:
        parts.append(_extra_logits(q, extra_keys, extra_bias, dtype))
    parts.append(jnp.broadcast_to(sinks.astype(jnp.float32)[None, None, :, None],
                                  logits.shape[:-1] + (1,)))
    probs = jax.nn.softmax(jnp.concatenate(parts, axis=-1), axis=-1)
    out = einsum("bshk,bkd->bshd", probs[..., :keys.shape[1]], keys, out_dtype=jnp.float32,
                 dtype=dtype)
    if extra_keys is not None:
        out = out + _extra_values(probs[..., keys.shape[1]:-1], extra_keys, dtype)
    return out.astype(dtype)


chunk_attention_dense.opt_in = True


def chunk_block_size(window: int) -> int:
    """Query block of the blocked chunk attention: the window rounded up to 8 (>= 8)."""
    return max(8, -(-window // 8) * 8)


def window_blocks(kv, start, n_new, ring_kv, ring_pos, window: int, key_floor=None):
    """The blocked window of a chunk (`kernels.chunk_attention`'s arguments): the chunk cut
    into nb query blocks of Q = `chunk_block_size(window)` tokens (padded to nb * Q), block i's
    keys E[iQ : iQ + R + Q] of E = [ring slots in position order | chunk keys] -- every key
    its queries' windows can hold (R >= window) -- and their visibility.
    Returns (k_blk [B,nb,R+Q,d] in kv's dtype, ok [B,nb,Q,R+Q] bool).

    The ring is put in position order by a per-row rotation: slot (start - R + j) % R holds
    position start - R + j or a position older than every window of the chunk."""
    dtype = kv.dtype
    b, s = kv.shape[:2]
    r = ring_kv.shape[1]
    if r < window:
        raise ValueError(f"chunk_attention: ring of {r} slots < window {window}")
    qb = chunk_block_size(window)
    nb = -(-s // qb)
    pad = nb * qb - s
    positions, ring, chunk = _chunk_key_positions(start, n_new, ring_pos, s, key_floor)
    order = (start[:, None] - r + jnp.arange(r, dtype=jnp.int32)) % r            # [B, R]
    ring_kv = jnp.take_along_axis(ring_kv.astype(dtype), order[..., None], axis=1)
    ring = jnp.take_along_axis(ring, order, axis=1)
    e_kv = jnp.concatenate([ring_kv, jnp.pad(kv, ((0, 0), (0, pad), (0, 0)))], axis=1)
    e_pos = jnp.concatenate([ring, jnp.pad(chunk, ((0, 0), (0, pad)), constant_values=-1)], 1)
    take = (jnp.arange(nb) * qb)[:, None] + jnp.arange(r + qb)[None]            # [nb, R+Q]
    q_pos = jnp.pad(positions, ((0, 0), (0, pad))).reshape(b, nb, qb)
    return e_kv[:, take], _window_ok(q_pos, e_pos[:, take], window)


@register("chunk_attention", "xla")
def chunk_attention(q, kv, start, n_new, ring_kv, ring_pos, sinks, *, window,
                    extra_keys=None, extra_bias=None, key_floor=None, q_norm_eps=None,
                    q_rope=None):
    """`kernels.chunk_attention` in XLA, the window blocked (`window_blocks`): each query
    block of Q tokens attends to its R + Q keys, so S x (R + Q) logits instead of S x (R + S)."""
    q = prepared_query(q, q_norm_eps, q_rope)
    dtype = kv.dtype
    b, s, h, d = q.shape
    k_blk, ok = window_blocks(kv, start, n_new, ring_kv, ring_pos, window, key_floor)
    nb, qb = ok.shape[1:3]
    sp = nb * qb
    pad = sp - s
    q_blk = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, nb, qb, h, d)
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    lw = einsum("bnqhd,bnkd->bnqhk", q_blk, k_blk, out_dtype=jnp.float32, dtype=dtype) * scale
    lw = jnp.where(ok[:, :, :, None, :], lw, -jnp.inf)
    sink = sinks.astype(jnp.float32)[None, None, None, :]
    m = jnp.maximum(lw.max(-1), sink)                                            # [B,nb,Q,H]
    le = None
    if extra_keys is not None:
        if extra_keys.ndim == 4:
            extra_keys = jnp.pad(extra_keys, ((0, 0), (0, pad), (0, 0), (0, 0)))
        extra_bias = jnp.pad(extra_bias, ((0, 0), (0, pad), (0, 0)))
        le = _extra_logits(jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))), extra_keys,
                           extra_bias, dtype)                                    # [B,Sp,H,K]
        m = jnp.maximum(m, le.max(-1).reshape(b, nb, qb, h))
    pw = jnp.exp(lw - m[..., None])
    den = pw.sum(-1) + jnp.exp(sink - m)
    if le is not None:
        pe = jnp.exp(le - m.reshape(b, sp, h)[..., None])
        den = den + pe.sum(-1).reshape(b, nb, qb, h)
    out = einsum("bnqhk,bnkd->bnqhd", pw / den[..., None], k_blk, out_dtype=jnp.float32,
                 dtype=dtype).reshape(b, sp, h, d)
    if le is not None:
        out = out + _extra_values(pe / den.reshape(b, sp, h)[..., None], extra_keys, dtype)
    return out[:, :s].astype(dtype)


def _one_zero(x):
    """x with -0.0 replaced by +0.0: the top-k ops order zeros of either sign as one value.
    Matched by bit pattern: a float compare would also take denormals for zero where the
    platform flushes them."""
    utype = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[x.dtype.itemsize]
    minus_zero = utype(1 << (8 * x.dtype.itemsize - 1))
    return jnp.where(jax.lax.bitcast_convert_type(x, utype) == minus_zero, jnp.zeros_like(x), x)


@register("top_k_rows", "xla")
def top_k_rows(scores, visible, k):
    """`kernels.top_k_rows` by `lax.top_k` (indices by decreasing score)."""
    k = min(k, scores.shape[-1])
    masked = jnp.where(visible, _one_zero(scores), -jnp.inf)
    _, idx = jax.lax.top_k(masked, k)
    return jnp.where(jnp.take_along_axis(visible, idx, axis=-1), idx, -1).astype(jnp.int32)


def _sortable_key(x) -> tuple[jax.Array, int]:
    """Float -> (uint32 key, significant bits): keys compare like the floats' total order,
    -0.0 taken as +0.0."""
    if x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        x = x.astype(jnp.float32)
    x = _one_zero(x)
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


def _kth_largest_key(key, k: int, width: int, bits: int):
    """Radix select on uint32 keys [rows, n] (`width` significant bits), 0 < k <= n: the k-th
    largest key T [rows, 1] and the count of keys above it [rows, 1].

    Each pass fixes the next digit of T from, for every digit value j, the count of keys that
    match the digits fixed so far and have digit >= j: up to 16 digit values as sibling sums
    over the keys (XLA fuses them into one pass that reads each key once), more as one
    compare-and-reduce over a [rows, 2^bits, n] broadcast."""
    rows = key.shape[0]
    prefix = jnp.zeros((rows, 1), jnp.uint32)   # digits of T fixed so far
    above = jnp.zeros((rows, 1), jnp.int32)     # keys above every key with that prefix
    done = 0
    while done < width:
        b = min(bits, width - done)
        shift = width - done - b
        digit = (key >> shift) & jnp.uint32((1 << b) - 1)
        match = ((key >> (shift + b)) == prefix) if done else jnp.ones_like(digit, bool)
        if b <= 4:
            counts = jnp.concatenate(
                [jnp.sum(match & (digit >= j), axis=-1, keepdims=True, dtype=jnp.int32)
                 for j in range(1 << b)], axis=-1)
        else:
            j = jnp.arange(1 << b, dtype=jnp.uint32)
            ge = (digit[:, None, :] >= j[None, :, None]) & match[:, None, :]
            counts = jnp.sum(ge, axis=-1, dtype=jnp.int32)
        # counts [rows, 2^b] fall with j; counts[:, 0] reaches k - above
        reach = above + counts >= k
        d = jnp.sum(reach, axis=-1, keepdims=True, dtype=jnp.int32) - 1
        # counts[d + 1] (0 past the end): the largest count that does not reach k
        nxt = jnp.max(jnp.where(reach, 0, counts), axis=-1, keepdims=True)
        above = above + nxt
        prefix = (prefix << b) | d.astype(jnp.uint32)
        done += b
    return prefix, above


def _radix_choice(scores, visible, k: int, radix_bits: int | None):
    """scores, visible [..., N] -> (key > T, key == T) [rows, N] bool, the count of ties to
    keep k - #(key > T) [rows, 1] and visible [rows, N], T the k-th largest key of each row
    (`_kth_largest_key`; invisible rows count as -inf)."""
    n = scores.shape[-1]
    key, width = _sortable_key(jnp.where(visible, scores, -jnp.inf))
    key = key.reshape(-1, n)
    bits = radix_bits or _radix_bits(key.shape[0], n)
    threshold, above = _kth_largest_key(key, k, width, bits)
    return key > threshold, key == threshold, k - above, visible.reshape(-1, n)


@register("top_k_rows", "xla_select")
def top_k_rows_select(scores, visible, k, radix_bits: int | None = None):
    """Radix select on the float bit pattern, no sort. Opt-in (DEEPINFER_KERNELS=
    top_k_rows=xla_select): it wins over lax.top_k only for few sequences over many rows
    (benchmarks/topk_compressor.py).

    The k-th largest key T by `_kth_largest_key`; then rows with key > T, and the
    lowest-index `k - #(key > T)` rows with key == T, are compacted in index order (one
    cumsum, one scatter)."""
    n = scores.shape[-1]
    k = min(k, n)
    lead = scores.shape[:-1]
    if k == 0:
        return jnp.zeros(lead + (0,), jnp.int32)
    gt, eq, need, vis = _radix_choice(scores, visible, k, radix_bits)
    rows = gt.shape[0]
    incl = jnp.cumsum(jnp.stack([gt, eq]).astype(jnp.int32), axis=-1)
    before_gt, before_eq = incl[0] - gt, incl[1] - eq
    take = (gt | (eq & (before_eq < need))) & vis
    pos = jnp.where(take, before_gt + jnp.minimum(before_eq, need), k)
    out = jnp.full((rows, k), -1, jnp.int32)
    out = out.at[jnp.arange(rows)[:, None], pos].set(
        jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (rows, n)), mode="drop")
    return out.reshape(lead + (k,))


@register("top_k_mask", "xla")
def top_k_mask(scores, visible, k):
    """`kernels.top_k_mask` from lax.top_k's indices (`top_k_rows`), scattered into a mask."""
    if min(k, scores.shape[-1]) == 0:
        return jnp.zeros_like(visible)
    idx = top_k_rows(scores, visible, k)
    chosen = jnp.zeros(scores.shape, bool)
    chosen = jnp.put_along_axis(chosen, jnp.maximum(idx, 0), True, axis=-1, inplace=False)
    return chosen & visible


@register("top_k_mask", "xla_select")
def top_k_mask_select(scores, visible, k, radix_bits: int | None = None):
    """`kernels.top_k_mask` by radix select (`_kth_largest_key`): no sort and no scatter,
    the mask compares each key with the row's k-th largest (ties by one cumsum)."""
    n = scores.shape[-1]
    k = min(k, n)
    if k == 0:
        return jnp.zeros_like(visible)
    gt, eq, need, vis = _radix_choice(scores, visible, k, radix_bits)
    before_eq = jnp.cumsum(eq.astype(jnp.int32), axis=-1) - eq
    return ((gt | (eq & (before_eq < need))) & vis).reshape(scores.shape)


@register("mhc_pre", "xla")
def mhc_pre(streams, fn, base, scale, norm_weight, *, iters, hc_eps, norm_eps):
    """`kernels.mhc_pre` in XLA (`mhc_math`)."""
    pre, post, comb = mhc_weights(streams, fn, base, scale, n=streams.shape[-2], iters=iters,
                                  hc_eps=hc_eps, norm_eps=norm_eps)
    return rms_norm(collapse(streams, pre), norm_weight, norm_eps), post, comb


@register("sinkhorn", "xla")
def sinkhorn(logits, *, iters, eps):
    """`kernels.sinkhorn` in XLA (`mhc_math.sinkhorn`, unrolled)."""
    return mhc_math.sinkhorn(logits, iters, eps)


@register("mhc_post", "xla")
def mhc_post(streams, y, post, comb):
    """`kernels.mhc_post` in XLA (`mhc_math.expand`)."""
    return expand(streams, y, post, comb)


def compressor_row_finish(p, pooled, position, ratio: int, freqs, eps: float):
    """pooled [B, d] -> RMSNorm (weight p["norm"]) + compress RoPE at m * (position // m)."""
    row = rms_norm(pooled, p["norm"], eps, out_dtype=pooled.dtype)
    cos, sin = rope_cos_sin((position // ratio) * ratio, freqs, row.dtype)
    return apply_rope(row, cos, sin)


@register("compressor_decode", "xla")
def compressor_decode(x, position, params, rings, ratio, freqs, eps):
    """`kernels.compressor_decode` in XLA: the window gathered from the ring, softmax pooling."""
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
