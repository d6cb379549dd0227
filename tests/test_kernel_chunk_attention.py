"""`kernels.chunk_attention` (prefill chunks over the sliding window plus extra keys): the
blocked "xla" implementation and the dense "xla_dense" formula against a brute-force loop
over (row, token, head), with rings holding wrapped, stale and empty slots, padding tokens,
chunks that are not a multiple of the query block, shared and per-token extra keys."""

import jax
import numpy as np
import jax.numpy as jnp
import pytest

from deepinfer_fn import kernels
from deepinfer_fn.kernels_xla import chunk_block_size

IMPLS = ("xla", "xla_dense")


def _inputs(seed, b=3, s=37, h=4, d=16, r=11, window=8, n_extra=6, k_extra=5):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, s, h, d)).astype(np.float32)
    kv = rng.standard_normal((b, s, d)).astype(np.float32)
    ring_kv = rng.standard_normal((b, r, d)).astype(np.float32)
    start = np.array([0, 5, 29], np.int32)[:b]
    n_new = np.array([s, 20, 0], np.int32)[:b]
    ring_pos = np.full((b, r), -1, np.int32)
    for bi in range(b):   # the last r positions before start, at slot position % r
        for p in range(max(0, start[bi] - r), start[bi]):
            ring_pos[bi, p % r] = p
    ring_pos[-1, 3] = start[-1] + 4          # stale: at or past the start (rolled back)
    ring_pos[-1, 4] = max(start[-1] - r - 3, 0)   # older than any window
    sinks = rng.standard_normal(h).astype(np.float32)
    shared = rng.standard_normal((b, n_extra, d)).astype(np.float32)
    shared_bias = np.where(rng.random((b, s, n_extra)) < 0.5, 0.0, -np.inf).astype(np.float32)
    per_token = rng.standard_normal((b, s, k_extra, d)).astype(np.float32)
    per_token_bias = np.where(rng.random((b, s, k_extra)) < 0.5, 0.0, -np.inf).astype(np.float32)
    return dict(q=q, kv=kv, start=start, n_new=n_new, ring_kv=ring_kv, ring_pos=ring_pos,
                sinks=sinks, window=window), (shared, shared_bias), (per_token, per_token_bias)


def _loop(a, extra, floor=None):
    """Brute force: each valid query's visible keys (ring slots before start, chunk tokens
    before it, within the window, at or above the floor), the extra keys, one softmax with
    the sink."""
    q, kv, start, n_new = a["q"], a["kv"], a["start"], a["n_new"]
    floor = np.zeros_like(start) if floor is None else floor
    b, s, h, d = q.shape
    out = np.zeros_like(q)
    for bi in range(b):
        for j in range(n_new[bi]):
            t = start[bi] + j
            keys = [a["ring_kv"][bi, i] for i in range(a["ring_pos"].shape[1])
                    if max(0, floor[bi]) <= a["ring_pos"][bi, i] < start[bi]
                    and t - a["window"] < a["ring_pos"][bi, i] <= t]
            keys += [kv[bi, i] for i in range(j + 1)
                     if start[bi] + i > t - a["window"] and start[bi] + i >= floor[bi]]
            bias = [0.0] * len(keys)
            if extra is not None:
                ek, eb = extra
                ek = ek[bi] if ek.ndim == 3 else ek[bi, j]
                keys += list(ek)
                bias += list(eb[bi, j])
            keys, bias = np.array(keys), np.array(bias)
            for hi in range(h):
                logits = keys @ q[bi, j, hi] / np.sqrt(d) + bias
                m = max(logits.max(), a["sinks"][hi])
                z = np.exp(logits - m)
                out[bi, j, hi] = z @ keys / (z.sum() + np.exp(a["sinks"][hi] - m))
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("extra", ["none", "shared", "per_token"])
def test_chunk_attention_against_loop(impl, extra):
    a, shared, per_token = _inputs(0)
    ex = {"none": None, "shared": shared, "per_token": per_token}[extra]
    kw = {} if ex is None else dict(extra_keys=jnp.asarray(ex[0]), extra_bias=jnp.asarray(ex[1]))
    with kernels.use("chunk_attention", impl):
        got = np.asarray(kernels.chunk_attention(
            jnp.asarray(a["q"]), jnp.asarray(a["kv"]), jnp.asarray(a["start"]),
            jnp.asarray(a["n_new"]), jnp.asarray(a["ring_kv"]), jnp.asarray(a["ring_pos"]),
            jnp.asarray(a["sinks"]), window=a["window"], **kw))
    want = _loop(a, ex)
    valid = np.arange(a["q"].shape[1])[None] < a["n_new"][:, None]
    assert a["q"].shape[1] % chunk_block_size(a["window"]) != 0   # a partial last block
    np.testing.assert_allclose(got[valid], want[valid], rtol=2e-5, atol=2e-5)


def test_chunk_attention_bf16_blocked_equals_dense():
    """bf16 keys: the blocked and dense implementations agree to bf16 rounding."""
    a, shared, _ = _inputs(1, s=70, r=16, window=16)
    args = [jnp.asarray(a[k], jnp.bfloat16 if k in ("q", "kv", "ring_kv") else None)
            for k in ("q", "kv", "start", "n_new", "ring_kv", "ring_pos", "sinks")]
    kw = dict(window=a["window"], extra_keys=jnp.asarray(shared[0], jnp.bfloat16),
              extra_bias=jnp.asarray(shared[1]))
    got = [np.asarray(kernels.implementation("chunk_attention", i)(*args, **kw), np.float32)
           for i in IMPLS]
    valid = np.arange(70)[None] < a["n_new"][:, None]
    np.testing.assert_allclose(got[0][valid], got[1][valid], rtol=0, atol=3e-2)


def test_chunk_attention_rejects_a_ring_shorter_than_the_window():
    a, _, _ = _inputs(2, r=6, window=8)
    with pytest.raises(ValueError, match="ring of 6 slots < window 8"):
        kernels.implementation("chunk_attention", "xla")(
            *[jnp.asarray(a[k]) for k in ("q", "kv", "start", "n_new", "ring_kv", "ring_pos",
                                          "sinks")], window=a["window"])


@pytest.mark.parametrize("impl", IMPLS)
def test_chunk_attention_key_floor(impl):
    """Window keys below key_floor are invisible (V4.1 decoder bounded replay): floors inside
    the ring, inside the chunk and below everything."""
    a, shared, _ = _inputs(3)
    floor = np.array([9, 2, 0], np.int32)
    with kernels.use("chunk_attention", impl):
        got = np.asarray(kernels.chunk_attention(
            *[jnp.asarray(a[k]) for k in ("q", "kv", "start", "n_new", "ring_kv", "ring_pos",
                                          "sinks")], window=a["window"],
            extra_keys=jnp.asarray(shared[0]), extra_bias=jnp.asarray(shared[1]),
            key_floor=jnp.asarray(floor)))
    want = _loop(a, shared, floor)
    valid = np.arange(a["q"].shape[1])[None] < a["n_new"][:, None]
    np.testing.assert_allclose(got[valid], want[valid], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_chunk_attention_raw_query_equals_prepared(impl):
    """A raw query with q_norm_eps / q_rope: the same result, bit for bit, as the query
    normalised and rotated by `query_and_kv`'s own functions first (bf16)."""
    from deepinfer_fn.model.common import head_rms
    from deepinfer_fn.model.rope import apply_rope
    a, shared, _ = _inputs(5, s=40, h=4, d=32, r=16, window=16)
    rng = np.random.default_rng(5)
    bf = jnp.bfloat16
    q = jnp.asarray(a["q"] * np.exp(rng.uniform(-2, 2, a["q"].shape[:3] + (1,))), bf)
    angles = rng.uniform(0, 6.3, a["q"].shape[:2] + (4,))
    cos, sin = jnp.asarray(np.cos(angles), bf), jnp.asarray(np.sin(angles), bf)
    rest = [jnp.asarray(a[k], bf if k in ("kv", "ring_kv") else None)
            for k in ("kv", "start", "n_new", "ring_kv", "ring_pos", "sinks")]
    kw = dict(window=a["window"], extra_keys=jnp.asarray(shared[0], bf),
              extra_bias=jnp.asarray(shared[1]))
    fn = kernels.implementation("chunk_attention", impl)
    got = fn(q, *rest, q_norm_eps=1e-6, q_rope=(cos, sin), **kw)
    want = fn(apply_rope(head_rms(q, 1e-6), cos[:, :, None], sin[:, :, None]), *rest, **kw)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    rotated = fn(q, *rest, q_rope=(cos, sin), **kw)        # rotation only (V4.1: no head norm)
    want = fn(apply_rope(q, cos[:, :, None], sin[:, :, None]), *rest, **kw)
    np.testing.assert_array_equal(np.asarray(rotated, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_rope_in_place_equals_rope(dtype):
    """`apply_rope_in_place` writes the same values as `apply_rope`, both directions."""
    from deepinfer_fn.model.rope import apply_rope, apply_rope_in_place
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((2, 9, 3, 32)), dtype)
    angles = rng.uniform(0, 6.3, (2, 9, 1, 8))
    cos, sin = jnp.asarray(np.cos(angles), dtype), jnp.asarray(np.sin(angles), dtype)
    for inverse in (False, True):
        got = jax.jit(apply_rope_in_place, static_argnums=3)(x, cos, sin, inverse)
        want = apply_rope(x, cos, sin, inverse)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
