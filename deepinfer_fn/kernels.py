"""Kernel ops: one public function per hot op; which implementation runs is chosen by the
registry (`kernel_registry`: platform preference, `use(op, impl)`, or the environment variable
`DEEPINFER_KERNELS="op=impl,op=impl"`). The model calls only the functions here. Every
implementation is tested against the XLA reference (tests/test_kernels.py).

Backends:
  xla         pure XLA, every platform: the reference (`kernels_xla`; `linear` and
              `grouped_linear`, `linear_many` live in `model.common` and are re-exported here). For
              `chunk_attention` it is the blocked window; `xla_dense` (opt-in) is the dense
              formula it is tested against.
  xla_select  pure XLA, opt-in: `top_k_rows` and `top_k_mask` by radix select instead of
              a sort.
  mosaic_gpu  Pallas Mosaic GPU kernels for NVIDIA Hopper (the `custom_calls` package).
              Chosen by default on an sm_90 GPU for `grouped_matmul` and `sparse_attention`,
              for `linear` / `grouped_linear` on at most 64 rows (decode projections: the
              weight streamed once, also out of a scanned layer stack), `linear_many` on
              at most 64 rows (the projections of one input in one launch), and for
              `mhc_pre` (one kernel on streams of n * D <= 1024 from 128 tokens; on
              wider streams a split-D pair of kernels from 2048 tokens; otherwise XLA with
              the Sinkhorn kernel), `mhc_post` on n * D <= 1024 from 128 tokens
              (`fn.prefers`), and `sinkhorn` (the
              unrolled Sinkhorn is most of XLA's compile time of a layer); `attention` and
              `compressor_decode` are opt-in (`fn.opt_in = True`: no faster than XLA at
              decode sizes): force any of them with `use` or DEEPINFER_KERNELS, e.g.
              "mhc_pre=mosaic_gpu,mhc_post=mosaic_gpu". `grouped_swiglu` (the routed
              experts' gate and up GEMMs and their SwiGLU in one kernel) is opt-in too
              until timed on a GPU; its XLA path runs the chosen `grouped_matmul` twice.
              Prefill chunks take
              `chunk_attention` (more than 16 tokens) and `index_scores` (at least 64).
  sm100       NVIDIA Blackwell dispatch point: not built (no SM100 hardware was available).
  ascend      Huawei Ascend dispatch point: needs CANN 9.2, not built.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp

from deepinfer_fn import kernels_xla
from deepinfer_fn.kernel_registry import (KernelUnavailable, call, choose, implementation,
                                          implementations, register, register_unbuilt, use)
from deepinfer_fn.model.common import grouped_linear, linear, linear_many
import custom_calls  # noqa: F401  registers the Mosaic GPU implementations

compressor_row_finish = kernels_xla.compressor_row_finish

__all__ = ["KernelUnavailable", "call", "choose", "implementation", "implementations", "register",
           "register_unbuilt", "use", "grouped_matmul", "grouped_swiglu", "attention", "sparse_attention",
           "chunk_attention", "index_scores", "top_k_rows", "top_k_mask", "mhc_pre", "mhc_post",
           "sinkhorn", "compressor_decode",
           "compressor_row_finish", "linear", "grouped_linear", "linear_many"]

_NO_SM100 = "no SM100 (Blackwell) hardware was available to build and test it"
_NO_CANN = "the Ascend backend needs CANN 9.2, which this build does not include"
for _op in ("grouped_matmul", "grouped_swiglu", "attention", "sparse_attention", "mhc_pre", "mhc_post", "sinkhorn",
            "linear", "grouped_linear", "linear_many"):
    register_unbuilt(_op, "sm100", _NO_SM100)
    register_unbuilt(_op, "ascend", _NO_CANN)


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Rows of x [M, K] sorted by group; w [G, K, N]; group_sizes [G] int32 -> [M, N].

    Row block g (group_sizes[g] rows) is multiplied by w[g]. Rows past sum(group_sizes)
    are zero. fp32 accumulation, result in w's dtype.
    """
    return call("grouped_matmul", x, w, group_sizes)


def grouped_swiglu(x: jax.Array, w1: jax.Array, w3: jax.Array, group_sizes: jax.Array, *,
                   limit: float) -> jax.Array:
    """The routed experts' first layer: swiglu(x @ w1[g], x @ w3[g], limit) [M, N] (spec §2.9,
    `model.common.swiglu`), rows of x [M, K] sorted by group as in `grouped_matmul`; w1, w3
    [G, K, N]. Each product is rounded to w's dtype before the SwiGLU (fp32); the result is
    in w's dtype; rows past sum(group_sizes) are zero."""
    if w1.shape != w3.shape or w1.dtype != w3.dtype or x.shape[-1] != w1.shape[1]:
        raise ValueError(f"grouped_swiglu: x {x.shape} needs w1 and w3 of one shape and dtype "
                         f"[G, {x.shape[-1]}, N]; got w1 {w1.shape} {w1.dtype}, "
                         f"w3 {w3.shape} {w3.dtype}")
    return call("grouped_swiglu", x, w1, w3, group_sizes, limit=limit)


def attention(q, keys, bias, sinks) -> jax.Array:
    """Single-KV-head attention with a sink logit (spec §2.8).

    q [B, T, H, d]; keys [B, S, d] (K = V); bias [B, T, S] additive fp32 mask (0 or -inf);
    sinks [H] fp32. Returns o [B, T, H, d] = softmax([q.k/sqrt(d) + bias, sink]) @ keys,
    the sink's probability dropped. Logits and softmax in fp32.
    """
    return call("attention", q, keys, bias, sinks)


def sparse_attention(q, window_kv, window_bias, rows, row_idx, sinks) -> jax.Array:
    """Attention of S new tokens over window keys plus selected compressed rows (spec §2.8).

    q [B,S,H,d]; window_kv [B,Wk,d] (ring slots and/or the chunk's own keys, K = V);
    window_bias [B,S,Wk] fp32 additive (0 or -inf); rows [B,N,d] compressed rows;
    row_idx [B,S,K] int32 indices into rows, -1 = no row (masked); sinks [H] fp32.
    One softmax over [window logits, row logits, sink]; the sink's value is zero.
    Returns o [B,S,H,d] in rows' dtype. Logits and softmax in fp32.
    """
    return call("sparse_attention", q, window_kv, window_bias, rows, row_idx, sinks)


def chunk_attention(q, kv, start, n_new, ring_kv, ring_pos, sinks, *, window: int,
                    extra_keys=None, extra_bias=None, key_floor=None, q_norm_eps=None,
                    q_rope=None) -> jax.Array:
    """Attention of a chunk of new tokens over its sliding window, plus optional extra keys,
    one softmax with the sink logit (spec §2.8, §4): prefill chunks.

    q [B,S,H,d]; kv [B,S,d] the chunk's keys (K = V); token j of row b sits at position
    start[b] + j and is real for j < n_new[b] (padding keys are never visible; padding
    queries' outputs are unspecified); ring_kv [B,R,d], ring_pos [B,R] int32: earlier tokens
    at slot position % R (-1 = empty; slots at or past start are ignored), R >= window;
    sinks [H] fp32. Key position s is visible to query t iff t - window < s <= t.
    extra_keys: [B,N,d] shared by a row's tokens (compressed rows) or [B,S,K,d] a list per
    token (selected rows), extra_bias [B,S,N|K] fp32 additive (0 / -inf).
    key_floor [B] int32 (optional): window keys at positions below it are not visible
    (V4.1 decoder bounded replay).
    q_norm_eps, q_rope (optional): q is the raw query projection; the attention uses
    `kernels_xla.prepared_query(q, q_norm_eps, q_rope)`: the per-head RMS norm (if q_norm_eps),
    then the rotation of its last 2 x r/2 channels by q_rope = (cos, sin) [B,S,r/2] (spec
    §2.5), as `model.attention.query_and_kv` computes it. Kernels may fold the norm into the
    logits.
    Returns o [B,S,H,d] in kv's dtype; logits and softmax in fp32.
    """
    return call("chunk_attention", q, kv, start, n_new, ring_kv, ring_pos, sinks,
                window=window, extra_keys=extra_keys, extra_bias=extra_bias,
                key_floor=key_floor, q_norm_eps=q_norm_eps, q_rope=q_rope)


def index_scores(q_index, head_weights, index_rows) -> jax.Array:
    """Lightning-indexer scores I(t, w) = sum_h omega[t, h] relu(q[t, h] . K[w]) / sqrt(d_I)
    (spec §2.7): q_index [B,T,H,d_I], head_weights [B,T,H] fp32, index_rows [B,N,d_I] ->
    [B,T,N] fp32 (dots of operands in the rows' dtype, fp32 accumulation)."""
    return call("index_scores", q_index, head_weights, index_rows)


def top_k_rows(scores, visible, k: int) -> jax.Array:
    """Indices [..., min(k, N)] int32 of the best visible rows (spec §2.7 step 6, §4.5).

    scores [..., N] (any float dtype), visible [..., N] bool. Invisible rows are masked to
    -inf, the k largest taken (total order, except that -0.0 and +0.0 are one value, as
    torch.topk and XLA's GPU sort (CUB) compare them; ties go to the lower row index), and
    selected-but-invisible entries replaced by -1.
    Order: "xla" lists them by decreasing score (lax.top_k); "xla_select" by increasing row
    index, its -1 entries possibly in between. The set of valid indices is the same.
    """
    return call("top_k_rows", scores, visible, k)


def top_k_mask(scores, visible, k: int) -> jax.Array:
    """Boolean [..., N] mask of the rows `top_k_rows` selects (the same set, invisible rows
    never set): scores [..., N] (any float dtype), visible [..., N] bool. "xla" scatters
    lax.top_k's indices; "xla_select" compares each score with its row's k-th largest found
    by radix select (no sort, no scatter)."""
    if scores.shape != visible.shape:
        raise ValueError(f"top_k_mask: scores{scores.shape} and visible{visible.shape} must "
                         "have one shape")
    if isinstance(k, bool) or not hasattr(k, "__index__") or operator.index(k) < 0:
        raise ValueError(f"top_k_mask: k must be a non-negative int (got {k!r})")
    return call("top_k_mask", scores, visible, operator.index(k))


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


def sinkhorn(logits, *, iters: int, eps: float) -> jax.Array:
    """The mHC mixing matrix from its logits (spec §2.3 step 5): row softmax + eps, then
    alternate column / row normalisation (each sum + eps), `iters` column steps in all.

    logits [N, n, n] fp32 -> P [N, n, n] fp32, columns summing to ~1.
    """
    if logits.ndim != 3 or logits.shape[1] != logits.shape[2] or iters < 1:
        raise ValueError(f"sinkhorn: logits {logits.shape} must be [N, n, n], iters={iters} >= 1")
    return call("sinkhorn", logits.astype(jnp.float32), iters=iters, eps=eps)


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
