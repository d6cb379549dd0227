"""Sampling: temperature / top-k / top-p / min-p, grammar masks, per-request counter-based keys.

Everything here is pure and jittable: no host synchronisation, no Python work per token, so the
sampler runs inside the jitted decode step (docs/MODEL.md §D2.2, §D5).

Distribution drawn from, per row (one row = one request), in this order:

  0. `allowed_mask` (grammar constraint): disallowed tokens get logit -inf, before anything else.
  1. temperature: s = logits / T. Rows with T < GREEDY_TEMPERATURE (in particular T = 0) are
     greedy: the distribution is one-hot at argmax(masked logits), ties -> lowest token id.
  2. top-k (k = 0: off): keep the k highest-probability tokens.
  3. top-p (p = 1: off): nucleus over the top-k distribution *renormalised*: keep the smallest
     prefix of the remaining tokens (by descending probability) whose mass is >= p; the top token
     is always kept.
  4. min-p (0: off): keep tokens with p(v) >= min_p * p_max. This is a ratio test, so it gives the
     same set whether p is measured before or after steps 2-3 renormalise (the top token survives
     both); it is applied last.

  Then softmax over what is left. This is the brief's order and that of HF transformers'
  warpers and SGLang (temperature, top-k, top-p, min-p), with top-p measured on the
  top-k-renormalised distribution as HF and vLLM do. vLLM v1 differs in one respect: it applies
  min-p (an "argmax-invariant logits processor") before top-k/top-p, so there top-p's mass is
  measured after min-p; the two agree whenever min-p or top-p is off. Ties in the ranking used
  by top-k/top-p are broken by token id: among equal logits the lowest id ranks first, so
  exactly k tokens survive top-k.

Randomness is counter-based (`request_key`): a request's noise is a pure function of its seed,
its absolute position (and, for speculative decoding, its step counter, a role tag and a draft
slot), never of its batch row or of the other requests. Sampled rows use the Gumbel-max trick
with that noise: token = argmax(filtered_logits + G), G ~ Gumbel(0, 1)^V from the row's key; this
is the drafter-invariant form of docs/MODEL.md §D5.4, so a draft computed with the same key and
the same processed logits picks the same token.

Batch invariance: every computation is row-wise (reductions only along the vocabulary axis). The
only cross-row operations are `lax.cond` predicates ("does any row sample / need top-k or top-p /
use min-p") that choose between code paths giving bit-identical results for every row they
share, so they save work without changing any row's result. Tokens and kept sets are the same
across batch compositions (barring a filter threshold within an ulp of a token); on XLA:CPU,
normalised values (probabilities, logprobs) of tiny arrays can differ by an ulp because XLA
picks its exp vectorisation by array size (tests/test_sampling.py checks both).

Cost: rows without top-k/top-p skip the sort; otherwise one stable sort per row serves both.
"""

from __future__ import annotations

import dataclasses
import math
import enum
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import threefry_2x32

from deepinfer_fn.errors import ArgumentError, ArgumentTypeError
from deepinfer_fn.validate import describe

GREEDY_TEMPERATURE = 1e-5
"""Rows with temperature below this are greedy (vLLM's `_SAMPLING_EPS`); avoids logits / T overflow."""

_ABSENT = 0xFFFFFFFF  # folded into a key in place of an absent counter (no real counter gets there)


class Role(enum.IntEnum):
    """Role tag folded into a key, so the random streams of different uses never coincide
    (docs/MODEL.md §D5.2)."""

    GUMBEL = 0   # plain decoding / drafter-invariant mode: the Gumbel noise of the sampler
    DRAFT = 1    # standard speculative mode: the draft's own sampling noise
    ACCEPT = 2   # standard speculative mode: acceptance uniforms
    FINAL = 3    # standard speculative mode: residual / bonus draw


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-row sampling settings, so one batch mixes requests. Build with `sampling_params`."""

    temperature: jax.Array  # f32[B]; < GREEDY_TEMPERATURE (e.g. 0) => greedy
    top_k: jax.Array        # i32[B]; 0 => off
    top_p: jax.Array        # f32[B]; 1.0 => off
    min_p: jax.Array        # f32[B]; 0.0 => off
    seed: jax.Array         # u32[B]; the request's seed

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    def greedy(self) -> jax.Array:
        """bool[B]: rows that take the argmax."""
        return self.temperature < GREEDY_TEMPERATURE


def _per_row(name: str, value, batch: int, dtype) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except ValueError as e:
        raise ArgumentError(f"{name}: expected a scalar or a sequence of length batch={batch}: "
                            f"{e}") from None
    if arr.ndim == 0:
        arr = np.full((batch,), arr)
    elif arr.ndim != 1 or arr.shape[0] != batch:
        raise ArgumentError(f"{name}: expected a scalar or a sequence of length batch={batch}, "
                            f"got shape {arr.shape}")
    if arr.dtype == object or arr.dtype.kind not in "biuf":
        raise ArgumentTypeError(f"{name}: expected numbers, got dtype {arr.dtype} "
                                f"({describe(value)})")
    if arr.dtype.kind == "b":
        raise ArgumentTypeError(f"{name}: expected numbers, got a bool {describe(value)}")
    if not np.all(np.isfinite(arr.astype(np.float64))):
        raise ArgumentError(f"{name}: values must be finite, got {arr.tolist()}")
    if np.dtype(dtype).kind in "iu" and np.any(arr != np.round(arr)):
        raise ArgumentError(f"{name}: values must be integers, got {arr.tolist()}")
    return arr.astype(np.float64)


def scalar_sampling_ok(temperature=0.0, top_k=None, top_p=None, min_p=None, seed=0) -> bool:
    """Fast host path for one row of plain Python numbers: True when `check_sampling` accepts
    them (False means "not known to be valid": call check_sampling for the error)."""
    vals = (temperature, 0 if top_k is None else top_k, 1.0 if top_p is None else top_p,
            0.0 if min_p is None else min_p, seed)
    if not all(type(v) in (int, float) for v in vals) or not all(map(math.isfinite, vals)):
        return False
    t, k, p, m, s = vals
    return (t >= 0 and k == int(k) and 0 <= k <= np.iinfo(np.int32).max and 0 < p <= 1
            and 0 <= m < 1 and s == int(s) and 0 <= s < 2**32)


def check_sampling(batch: int, temperature=0.0, top_k=None, top_p=None, min_p=None,
                   seed=0) -> tuple[np.ndarray, ...]:
    """Host-only validation of `sampling_params`' arguments (no device work): numpy
    (temperature, top_k, top_p, min_p, seed) arrays [batch], or ValueError (same rules)."""
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
        raise ArgumentError(f"batch must be a positive int, got {batch!r}")
    batch = int(batch)
    t = _per_row("temperature", temperature, batch, np.float32)
    k = _per_row("top_k", 0 if top_k is None else top_k, batch, np.int32)
    p = _per_row("top_p", 1.0 if top_p is None else top_p, batch, np.float32)
    m = _per_row("min_p", 0.0 if min_p is None else min_p, batch, np.float32)
    s = _per_row("seed", seed, batch, np.uint32)
    if np.any(t < 0):
        raise ArgumentError(f"temperature must be >= 0 (0 = greedy), got {t.tolist()}")
    if np.any(k < 0) or np.any(k > np.iinfo(np.int32).max):
        raise ArgumentError(f"top_k must be >= 0 (0 = off), got {k.astype(np.int64).tolist()}")
    if np.any(p <= 0) or np.any(p > 1):
        raise ArgumentError(f"top_p must be in (0, 1] (1 = off), got {p.tolist()}")
    if np.any(m < 0) or np.any(m >= 1):
        raise ArgumentError(f"min_p must be in [0, 1) (0 = off), got {m.tolist()}")
    if np.any(s < 0) or np.any(s >= 2**32):
        raise ArgumentError(f"seed must be in [0, 2**32), got {s.astype(np.int64).tolist()}")
    return t, k, p, m, s


def sampling_params(batch: int, temperature=0.0, top_k=None, top_p=None, min_p=None,
                    seed=0) -> SamplingParams:
    """Per-row `SamplingParams` for a batch; each argument is a scalar (broadcast) or a sequence.

    None disables a filter (top_k 0, top_p 1.0, min_p 0.0). Raises ValueError on a wrong length
    or a value out of range: temperature >= 0, top_k >= 0, top_p in (0, 1], min_p in [0, 1),
    seed in [0, 2**32).
    """
    t, k, p, m, s = check_sampling(batch, temperature, top_k, top_p, min_p, seed)
    # Converted on the host and put with device_put: jnp.asarray would compile a small
    # program per shape and dtype.
    put = lambda v, dtype: jax.device_put(np.asarray(v).astype(dtype))
    return SamplingParams(temperature=put(t, np.float32), top_k=put(k, np.int32),
                          top_p=put(p, np.float32), min_p=put(m, np.float32),
                          seed=put(s, np.uint32))


def request_key(seed, position, *, step=None, slot=None, role: int = Role.GUMBEL) -> jax.Array:
    """Counter-based threefry keys, one per element: a pure function of the request's counters.

    key = fold(fold(fold(fold(key(seed), position), step), role), slot), always all four folds
    in this order, an absent counter (None) folded as 0xFFFFFFFF, so every field has a fixed
    meaning and different combinations never share a stream. Plain decoding uses
    (seed, position, GUMBEL); speculative decoding adds the request-local step counter and the
    draft slot (docs/MODEL.md §D5.2). Arguments broadcast against each other (e.g. [B] or
    [B, γ]); the result is a typed key array of the broadcast shape.
    """
    def counter(x):
        return jnp.full((), _ABSENT, jnp.uint32) if x is None else jnp.asarray(x).astype(jnp.uint32)

    fields = jnp.broadcast_arrays(jnp.asarray(seed).astype(jnp.uint32), counter(position),
                                  counter(step), jnp.asarray(role).astype(jnp.uint32),
                                  counter(slot))
    shape = fields[0].shape

    def one(s, pos, st, r, sl):
        key = jax.random.key(s, impl="threefry2x32")
        for data in (pos, st, r, sl):
            key = jax.random.fold_in(key, data)
        return key

    keys = jax.vmap(one)(*(f.reshape(-1) for f in fields))
    return keys.reshape(shape)


def gumbel_noise(keys: jax.Array, vocab_size: int) -> jax.Array:
    """f32[..., V]: standard Gumbel noise, one independent vector per key (row-wise, via vmap).

    Defined explicitly so other code (a fused kernel, a draft) can regenerate the same noise:
    bits = threefry_2x32(key_data(key), arange(V)) (jax's 2-words-per-hash layout, half the
    hashes of `jax.random.bits` in partitionable mode), u = min(((bits >> 8) + 0.5) / 2**24,
    1 - 2**-24) in (0, 1), G = -log(-log(u)). The clamp matters: in float32 the top value
    2**24 - 0.5 rounds to 2**24, i.e. u = 1 and G = +inf, which would win the argmax even
    against a masked (-inf: nan) or filtered-out token.
    """
    counters = jnp.arange(vocab_size, dtype=jnp.uint32)

    def one(key):
        data = jax.random.key_data(key)
        bits = threefry_2x32((data[0], data[1]), counters)
        u = ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))
        u = jnp.minimum(u, jnp.float32(1.0 - 2.0 ** -24))
        return -jnp.log(-jnp.log(u))

    flat = keys.reshape(-1)
    return jax.vmap(one)(flat).reshape(*keys.shape, vocab_size)


def _masked(logits, allowed_mask):
    logits = jnp.asarray(logits).astype(jnp.float32)
    if allowed_mask is None:
        return logits
    return jnp.where(allowed_mask, logits, -jnp.inf)


def _row_max(x):
    """Row max, 0 where a row is all -inf (keeps exp(x - max) NaN-free)."""
    m = jnp.max(x, axis=-1, keepdims=True)
    return jnp.where(jnp.isfinite(m), m, 0.0)


def _top_k_top_p_keep(scaled, top_k, top_p):
    """bool[B,V]: tokens kept by top-k then top-p (top-p on the top-k-renormalised distribution).

    One stable sort per row (descending logit; stability puts equal logits in id order), shared
    by both filters. Both keep a prefix of that ranking, so the kept set is the first n_keep
    ranks; it is mapped back to vocabulary order by comparing every token with the last kept
    (logit, id) pair, which needs no scatter.
    """
    vocab = scaled.shape[-1]
    ids = lax.broadcasted_iota(jnp.int32, scaled.shape, 1)
    neg_sorted, sorted_ids = lax.sort((-scaled, ids), dimension=1, num_keys=1, is_stable=True)
    s_sorted = -neg_sorted
    rank = ids
    n_k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)[:, None]       # [B,1]
    e = jnp.where(rank < n_k, jnp.exp(s_sorted - _row_max(s_sorted)), 0.0)      # unnormalised p
    z = jnp.sum(e, axis=-1, keepdims=True)
    mass_before = jnp.cumsum(e, axis=-1) - e                                      # exclusive prefix
    in_p = (top_p[:, None] >= 1.0) | (mass_before < top_p[:, None] * z)
    # n_p = first rank that top-p drops (robust to a non-monotone rounded prefix sum).
    n_p = jnp.where(jnp.all(in_p, axis=-1, keepdims=True), vocab,
                    jnp.argmin(in_p, axis=-1, keepdims=True))
    n_keep = jnp.clip(jnp.minimum(n_k, n_p), 1, vocab)                           # [B,1]
    last_val = jnp.take_along_axis(s_sorted, n_keep - 1, axis=-1)
    last_id = jnp.take_along_axis(sorted_ids, n_keep - 1, axis=-1)
    keep = (scaled > last_val) | ((scaled == last_val) & (ids <= last_id))
    off = ((top_k <= 0) | (top_k >= vocab)) & (top_p >= 1.0)
    return keep | off[:, None]


def _sampled_filter(masked, params):
    """f32[B,V]: where(kept, masked / T, -inf) for every row, as if none were greedy."""
    temperature = jnp.where(params.greedy(), 1.0, params.temperature)[:, None]
    scaled = masked / temperature
    scaled = jnp.where(scaled == 0.0, 0.0, scaled)  # -0.0 -> +0.0: sort order == comparison order
    needs_sort = (params.top_k > 0) | (params.top_p < 1.0)
    keep = lax.cond(jnp.any(needs_sort),
                    lambda: _top_k_top_p_keep(scaled, params.top_k, params.top_p),
                    lambda: jnp.ones(scaled.shape, bool))
    # min-p: p(v) / p_max = exp(s_v - s_max) >= min_p; a ratio, unchanged by renormalisation.
    keep &= lax.cond(jnp.any(params.min_p > 0.0),
                     lambda: jnp.exp(scaled - _row_max(scaled)) >= params.min_p[:, None],
                     lambda: jnp.ones(scaled.shape, bool))
    return jnp.where(keep, scaled, -jnp.inf)


def filter_logits(logits: jax.Array, params: SamplingParams, allowed_mask=None) -> jax.Array:
    """f32[B,V]: the processed logits that `sample` draws from; removed tokens are -inf.

    Sampled rows: where(kept, logits / T, -inf) after allowed_mask, temperature, top-k, top-p,
    min-p (module docstring). Greedy rows: -inf everywhere except the argmax of the masked
    logits (ties -> lowest id), which keeps its logit. softmax of the result is `probabilities`.
    """
    masked = _masked(logits, allowed_mask)
    greedy = params.greedy()[:, None]
    ids = lax.broadcasted_iota(jnp.int32, masked.shape, 1)
    top = jnp.argmax(masked, axis=-1)[:, None]
    one_hot = jnp.where(ids == top, masked, -jnp.inf)
    sampled = lax.cond(jnp.any(~greedy), lambda: _sampled_filter(masked, params),
                       lambda: one_hot)
    return jnp.where(greedy, one_hot, sampled)


def probabilities(logits: jax.Array, params: SamplingParams, allowed_mask=None) -> jax.Array:
    """f32[B,V]: the exact distribution `sample` draws each row from (one-hot for greedy rows).

    This is p̃ of docs/MODEL.md §D2.2 for the processors implemented here; a row with no allowed
    token is all zeros.
    """
    filtered = filter_logits(logits, params, allowed_mask)
    e = jnp.exp(filtered - _row_max(filtered))
    z = jnp.sum(e, axis=-1, keepdims=True)
    return jnp.where(z > 0, e / jnp.where(z > 0, z, 1.0), 0.0)


def sample(logits: jax.Array, params: SamplingParams, positions: jax.Array,
           allowed_mask=None) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row: (tokens i32[B], logprobs f32[B]).

    Greedy rows: argmax of the masked logits, ties -> lowest id. Sampled rows: Gumbel-max over
    `filter_logits` with the noise of request_key(seed, position, role=GUMBEL), so a row's token
    depends only on its logits, params, seed and position. `positions` is the absolute position
    of the token being sampled (any fixed per-request counter works, as long as it is unique).

    logprobs: log p(token) under the *model's* distribution restricted to the allowed tokens,
    log_softmax(where(allowed_mask, logits, -inf)) at the chosen token — before temperature and
    the top-k/top-p/min-p filters (vLLM's default "raw logprobs"). For the sampled-from
    distribution use log(probabilities(...)). A row with no allowed token returns token 0 and
    logprob -inf.
    """
    masked = _masked(logits, allowed_mask)
    vocab = masked.shape[-1]
    greedy = params.greedy()
    greedy_tokens = jnp.argmax(masked, axis=-1).astype(jnp.int32)

    def draw():
        filtered = _sampled_filter(masked, params)
        keys = request_key(params.seed, positions, role=Role.GUMBEL)
        return jnp.argmax(filtered + gumbel_noise(keys, vocab), axis=-1).astype(jnp.int32)

    sampled_tokens = lax.cond(jnp.any(~greedy), draw, lambda: greedy_tokens)
    tokens = jnp.where(greedy, greedy_tokens, sampled_tokens)

    m = _row_max(masked)
    lse = m[:, 0] + jnp.log(jnp.sum(jnp.exp(masked - m), axis=-1))
    chosen = jnp.take_along_axis(masked, tokens[:, None], axis=-1)[:, 0]
    return tokens, jnp.where(jnp.isfinite(chosen), chosen - lse, -jnp.inf)


__all__ = ["GREEDY_TEMPERATURE", "Role", "SamplingParams", "sampling_params", "request_key",
           "gumbel_noise", "filter_logits", "probabilities", "sample"]
