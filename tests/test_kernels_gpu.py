"""Mosaic GPU kernels (custom_calls/) against the XLA reference, on CPU (or on a Hopper GPU).

On a machine without an sm_90 GPU the kernels run under Pallas' GPU interpret mode, which
simulates the GPU's memories, warpgroups, barriers, TMA and wgmma on the CPU: the same kernel
code path as on an H100 / H200 except where custom_calls/flash_decode.py says otherwise (the
p @ V wgmma takes its A operand from shared memory there); on an H100 / H200 they run
natively (`INTERPRET`).
Lowering for CUDA is checked too (no GPU needed).

Every interpret-mode test feeds bf16 operands (fp32 only where the contract says so: biases,
sinks) and proves the kernel ran: its jaxpr holds a Pallas kernel launch in interpret mode
(`pallas_kernels`), so a silent fallback to the XLA reference fails the test.
"""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_fn import kernels, kernels_xla

try:
    from custom_calls import _common
    from custom_calls.grouped_matmul import grouped_matmul_mgpu
    from custom_calls.sparse_attention import sparse_attention_mgpu
    _IMPORT_ERROR = None
except ImportError as e:  # pragma: no cover - depends on the installed JAX
    _IMPORT_ERROR = e

pytestmark = pytest.mark.skipif(
    _IMPORT_ERROR is not None or not _common.interpret_available(),
    reason=f"Pallas Mosaic GPU interpret mode unavailable in this JAX: {_IMPORT_ERROR}")

INTERPRET = _IMPORT_ERROR is not None or not _common.on_hopper()  # natively on sm_90

_KERNEL_PRIMITIVES = ("pallas_call", "mpmd_map")  # plgpu.kernel binds mpmd_map in this JAX


def _sub_jaxprs(value):
    if isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)
    elif hasattr(value, "eqns"):
        yield value
    elif hasattr(getattr(value, "jaxpr", None), "eqns"):
        yield value.jaxpr


def pallas_kernels(fn, *args) -> list:
    """The `interpret` parameter of every Pallas kernel launch in fn's jaxpr (nested too)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in _KERNEL_PRIMITIVES:
                found.append(eqn.params.get("interpret"))
            for param in eqn.params.values():
                for sub in _sub_jaxprs(param):
                    walk(sub)
    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def run_kernel(fn, *args):
    """fn(*args) after checking that it launches a Pallas kernel (in interpret mode unless
    the tests run on a Hopper GPU)."""
    launches = pallas_kernels(fn, *args)
    assert launches, "no Pallas kernel in the jaxpr: the call fell back to XLA"
    assert all(bool(x) == INTERPRET for x in launches), f"interpret={INTERPRET}: {launches}"
    return fn(*args)


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _grouped(seed, m, k, n, g, pad, empty=()):
    rng = np.random.default_rng(seed)
    p = np.ones(g)
    p[list(empty)] = 0
    sizes = rng.multinomial(m - pad, p / p.sum()).astype(np.int32)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), jnp.bfloat16)
    return x, w, jnp.asarray(sizes)


def test_registered_and_not_chosen_on_cpu():
    for op in ("grouped_matmul", "grouped_swiglu", "sparse_attention", "attention", "chunk_attention",
               "index_scores", "linear", "linear_many"):
        assert "mosaic_gpu" in kernels.implementations(op)
        fn = kernels.implementation(op, "mosaic_gpu")
        assert fn.available() is (not INTERPRET)
        assert kernels.choose(op, "cpu") == "xla"
        # Without an sm_90 device the GPU preference falls back to XLA; opt-in kernels
        # (attention) run only when forced.
        default = "mosaic_gpu" if not INTERPRET and not getattr(fn, "opt_in", False) else "xla"
        assert kernels.choose(op, "gpu") == default
    with kernels.use("attention", "mosaic_gpu"):
        assert kernels.choose("attention", "gpu") == "mosaic_gpu"


@pytest.mark.parametrize("m,k,n,g,pad,empty,blocks", [
    (40, 64, 64, 5, 3, (1,), {}),                        # padding rows, an empty group
    (70, 96, 80, 4, 5, (0, 3), {"block_n": 64}),         # M, K, N not multiples of the tiles
    (6, 128, 64, 8, 0, (), {}),                          # decode: one row an expert
])
def test_grouped_matmul_interpret(m, k, n, g, pad, empty, blocks):
    x, w, sizes = _grouped(m + k + n, m, k, n, g, pad, empty)
    assert x.dtype == w.dtype == jnp.bfloat16
    fn = functools.partial(grouped_matmul_mgpu, interpret=INTERPRET, **blocks)
    got = np.asarray(run_kernel(fn, x, w, sizes).astype(jnp.float32))
    want = np.asarray(kernels_xla.grouped_matmul(x, w, sizes).astype(jnp.float32))
    assert got.shape == want.shape and not np.isnan(got).any()
    assert _rel(got, want) < 1e-2
    np.testing.assert_array_equal(got[m - pad:], 0.0)   # rows past sum(group_sizes)


@pytest.mark.parametrize("m,k,n,g,pad,empty,blocks", [
    (40, 64, 64, 5, 3, (1,), {}),                        # padding rows, an empty group
    (70, 96, 80, 4, 5, (0, 3), {"block_n": 64}),         # K, N not multiples of the tiles
    (6, 128, 128, 8, 0, (), {}),                         # decode: one row an expert
    (300, 128, 128, 3, 7, (), {"block_m": 128, "block_n": 64}),   # prefill tiles
])
def test_grouped_swiglu_interpret(m, k, n, g, pad, empty, blocks):
    """The fused gate / up GEMMs and SwiGLU against the unfused reference (two grouped GEMMs
    rounded to bf16, the SwiGLU in fp32), bf16, with the clip active on a share of the
    entries; the kernel must have run."""
    from custom_calls.grouped_matmul import grouped_swiglu_mgpu
    x, w1, sizes = _grouped(m + k, m, k, n, g, pad, empty)
    _, w3, _ = _grouped(m + k + 1, m, k, n, g, pad, empty)
    w1, w3 = (w1 * 4).astype(jnp.bfloat16), (w3 * 4).astype(jnp.bfloat16)
    limit = 3.0
    fn = functools.partial(grouped_swiglu_mgpu, limit=limit, interpret=INTERPRET, **blocks)
    got = np.asarray(run_kernel(fn, x, w1, w3, sizes).astype(jnp.float32))
    want = np.asarray(kernels_xla.grouped_swiglu(x, w1, w3, sizes, limit=limit)
                      .astype(jnp.float32))
    gate = np.asarray(kernels_xla.grouped_matmul(x, w1, sizes).astype(jnp.float32))
    assert (gate > limit).mean() > 0.01                  # the clip is exercised
    assert got.shape == want.shape and not np.isnan(got).any()
    assert _rel(got, want) < 1e-2
    np.testing.assert_array_equal(got[m - pad:], 0.0)   # rows past sum(group_sizes)


def test_grouped_swiglu_routes_and_falls_back():
    """The op's XLA path is the two registry GEMMs and the SwiGLU; the kernel serves fp32
    weights through it (no kernel in the jaxpr)."""
    from custom_calls.grouped_matmul import grouped_swiglu_mgpu
    from deepinfer_fn.model.common import swiglu
    x, w1, sizes = _grouped(3, 24, 16, 8, 3, 2)
    _, w3, _ = _grouped(4, 24, 16, 8, 3, 2)
    want = swiglu(kernels_xla.grouped_matmul(x, w1, sizes),
                  kernels_xla.grouped_matmul(x, w3, sizes), 10.0)
    np.testing.assert_array_equal(np.asarray(kernels.grouped_swiglu(x, w1, w3, sizes, limit=10.0)),
                                  np.asarray(want))
    with pytest.raises(ValueError, match="grouped_swiglu"):
        kernels.grouped_swiglu(x, w1, w3[:, :, :4], sizes, limit=10.0)
    x32, w1_32, w3_32 = (a.astype(jnp.float32) for a in (x, w1, w3))
    fn = functools.partial(grouped_swiglu_mgpu, limit=10.0)
    assert pallas_kernels(fn, x32, w1_32, w3_32, sizes) == []
    np.testing.assert_array_equal(
        np.asarray(fn(x32, w1_32, w3_32, sizes)),
        np.asarray(kernels_xla.grouped_swiglu(x32, w1_32, w3_32, sizes, limit=10.0)))


def test_grouped_matmul_fp32_falls_back_to_reference():
    x, w, sizes = _grouped(0, 24, 16, 8, 3, 2)
    x, w = x.astype(jnp.float32), w.astype(jnp.float32)
    assert pallas_kernels(grouped_matmul_mgpu, x, w, sizes) == []
    got = grouped_matmul_mgpu(x, w, sizes)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(kernels_xla.grouped_matmul(x, w, sizes)))


def _sparse(seed, b, s, h, d, wk, n, k, dtype=jnp.bfloat16, mask_split=False):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, s, h, d)), dtype)
    win = jnp.asarray(rng.standard_normal((b, wk, d)), dtype)
    vis = rng.random((b, s, wk)) < 0.8
    if mask_split:
        vis[0, 0, :] = False                 # a token whose whole window is masked
    wb = jnp.asarray(np.where(vis, 0.0, -np.inf), jnp.float32)
    rows = jnp.asarray(rng.standard_normal((b, n, d)), dtype)
    idx = rng.integers(0, n, (b, s, k))
    idx[rng.random((b, s, k)) < 0.25] = -1
    sinks = jnp.asarray(rng.standard_normal(h), jnp.float32)
    return q, win, wb, rows, jnp.asarray(idx, jnp.int32), sinks


@pytest.mark.parametrize("shape,splits", [
    ((2, 1, 8, 128, 64, 100, 64), 1),     # B=2, S=1, one CTA per token
    ((1, 2, 16, 256, 40, 50, 30), 2),     # S=2, Wk+K padded, keys split over 2 CTAs
])
def test_sparse_attention_interpret(shape, splits):
    args = _sparse(sum(shape), *shape, mask_split=splits == 2)
    assert args[0].dtype == args[1].dtype == args[3].dtype == jnp.bfloat16
    fn = functools.partial(sparse_attention_mgpu, interpret=INTERPRET, splits=splits)
    got = np.asarray(run_kernel(fn, *args).astype(jnp.float32))
    want = np.asarray(kernels_xla.sparse_attention(*args).astype(jnp.float32))
    assert got.shape == want.shape and not np.isnan(got).any()
    assert _rel(got, want) < 1e-2


def test_sparse_attention_unsupported_falls_back():
    args = _sparse(3, 1, 1, 4, 64, 8, 10, 6, dtype=jnp.float32)   # fp32, H=4, d=64
    assert pallas_kernels(sparse_attention_mgpu, *args) == []
    got = sparse_attention_mgpu(*args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(kernels_xla.sparse_attention(*args)))


def _chunk(seed, b, s, h, d, r, window, n_extra, start, n_new, floor=None):
    """bf16 chunk_attention inputs: rings holding the positions before each row's start
    (wrapped), shared extra keys with a random mask."""
    rng = np.random.default_rng(seed)
    rp = np.full((b, r), -1, np.int32)
    for bi in range(b):
        for p in range(max(0, start[bi] - r), start[bi]):
            rp[bi, p % r] = p
    bf = jnp.bfloat16
    args = (jnp.asarray(rng.standard_normal((b, s, h, d)), bf),
            jnp.asarray(rng.standard_normal((b, s, d)), bf), jnp.asarray(start, jnp.int32),
            jnp.asarray(n_new, jnp.int32), jnp.asarray(rng.standard_normal((b, r, d)), bf),
            jnp.asarray(rp), jnp.asarray(rng.standard_normal(h), jnp.float32))
    kw = {}
    if n_extra:
        kw = dict(extra_keys=jnp.asarray(rng.standard_normal((b, n_extra, d)), bf),
                  extra_bias=jnp.asarray(np.where(rng.random((b, s, n_extra)) < 0.5, 0.0,
                                                  -np.inf), jnp.float32))
    if floor is not None:
        kw["key_floor"] = jnp.asarray(floor, jnp.int32)
    return args, kw


@pytest.mark.parametrize("h,n_extra,floor", [
    (16, 10, None),      # 4 tokens a CTA, shared extra keys
    (8, 0, [3, 9]),      # 8 tokens a CTA, window only, a key floor (bounded replay)
])
def test_chunk_attention_interpret(h, n_extra, floor):
    from custom_calls.chunk_attention import chunk_attention_mgpu
    s, start, n_new = 37, [0, 5], [37, 30]
    args, kw = _chunk(h + n_extra, 2, s, h, 128, 11, 8, n_extra, start, n_new, floor)
    fn = functools.partial(chunk_attention_mgpu, window=8, interpret=INTERPRET, **kw)
    got = np.asarray(run_kernel(fn, *args).astype(jnp.float32))
    want = np.asarray(kernels_xla.chunk_attention(*args, window=8, **kw).astype(jnp.float32))
    valid = np.arange(s)[None] < np.asarray(n_new)[:, None]     # padding queries: unspecified
    assert got.shape == want.shape and not np.isnan(got[valid]).any()
    assert _rel(got[valid], want[valid]) < 1e-2


@pytest.mark.parametrize("head_norm,rope,in_kernel,switch", [
    (True, 64, True, True),      # V4: the kernel normalises and rotates the raw query tile
    (False, 64, True, True),     # V4.1 (no query head norm)
    (True, 32, False, True),     # a rotation narrower than one 64-lane tile: XLA folds it
    (True, 64, False, False),    # PREPARE_QUERY_IN_KERNEL off: XLA folds it
])
def test_chunk_attention_folded_query_interpret(head_norm, rope, in_kernel, switch, monkeypatch):
    """A raw query (q_norm_eps, q_rope): the kernel scales each row's logits by its head RMS
    factor and rotates the query's rope channels (in shared memory, or in place by XLA
    before it for other rope widths); the reference normalises and rotates the query first.
    Rows of very different norms (the factor matters)."""
    from custom_calls import chunk_attention, flash_decode
    calls = []
    real = flash_decode.flash_decode
    monkeypatch.setattr(chunk_attention, "flash_decode",
                        lambda *a, **k: calls.append(k) or real(*a, **k))
    monkeypatch.setattr(chunk_attention, "PREPARE_QUERY_IN_KERNEL", switch)
    s, h, start, n_new = 37, 16, [0, 5], [37, 30]
    args, kw = _chunk(21, 2, s, h, 128, 11, 8, 10, start, n_new)
    rng = np.random.default_rng(4)
    norms = jnp.asarray(np.exp(rng.uniform(-2.0, 2.5, (2, s, h, 1))), jnp.float32)
    q_raw = (args[0].astype(jnp.float32) * norms).astype(jnp.bfloat16)
    angles = rng.uniform(0, 2 * np.pi, (2, s, rope // 2))
    rope = (jnp.asarray(np.cos(angles), jnp.bfloat16), jnp.asarray(np.sin(angles), jnp.bfloat16))
    kw.update(q_norm_eps=1e-6 if head_norm else None, q_rope=rope)
    args = (q_raw,) + args[1:]
    want = np.asarray(kernels_xla.chunk_attention(*args, window=8, **kw).astype(jnp.float32))
    unnormed = np.asarray(kernels_xla.chunk_attention(
        args[0], *args[1:], window=8, extra_keys=kw["extra_keys"],
        extra_bias=kw["extra_bias"]).astype(jnp.float32))
    fn = functools.partial(chunk_attention.chunk_attention_mgpu, window=8,
                           interpret=INTERPRET, **kw)
    got = np.asarray(jax.block_until_ready(run_kernel(fn, *args)).astype(jnp.float32))
    valid = np.arange(s)[None] < np.asarray(n_new)[:, None]
    assert not np.isnan(got[valid]).any()
    assert _rel(unnormed[valid], want[valid]) > 0.1      # the norm and rotation matter here
    assert _rel(got[valid], want[valid]) < 1e-2
    assert calls                                          # the kernel path, prepared as said
    for kw in calls:
        assert (kw["q_rope"] is not None) == in_kernel
        assert (kw["q_scale"] is None) == (in_kernel or not head_norm)
        assert (kw["q_norm_eps"] is not None) == (in_kernel and head_norm)


def test_chunk_attention_prepared_query_mini_geometry_interpret():
    """The query prepared in the kernel at `mini`'s geometry (32 heads of d = 512: two tokens
    a CTA, the rotated 64 lanes at the end of warpgroup 1's half), raw query rows of very
    different norms, against the reference."""
    from custom_calls import chunk_attention
    s, h, d = 21, 32, 512
    args, kw = _chunk(5, 1, s, h, d, 11, 8, 6, [3], [s])
    rng = np.random.default_rng(6)
    norms = jnp.asarray(np.exp(rng.uniform(-2.0, 2.5, (1, s, h, 1))), jnp.float32)
    args = ((args[0].astype(jnp.float32) * norms).astype(jnp.bfloat16),) + args[1:]
    angles = rng.uniform(0, 2 * np.pi, (1, s, 32))
    kw.update(q_norm_eps=1e-6, q_rope=(jnp.asarray(np.cos(angles), jnp.bfloat16),
                                       jnp.asarray(np.sin(angles), jnp.bfloat16)))
    want = np.asarray(kernels_xla.chunk_attention(*args, window=8, **kw).astype(jnp.float32))
    fn = functools.partial(chunk_attention.chunk_attention_mgpu, window=8,
                           interpret=INTERPRET, **kw)
    got = np.asarray(run_kernel(fn, *args).astype(jnp.float32))
    assert not np.isnan(got).any() and _rel(got, want) < 1e-2


def test_chunk_attention_skips_masked_blocks_interpret():
    """CTAs of early tokens see fewer extra-key blocks: they visit 1 of 4 key blocks, the
    last ones 3 (the window's block and the visible prefix), with the same result."""
    from custom_calls.chunk_attention import block_keys, chunk_attention_mgpu
    from custom_calls.flash_decode import live_blocks
    s, h, n = 160, 16, 200
    args, _ = _chunk(11, 1, s, h, 128, 8, 8, 0, [0], [s])
    rng = np.random.default_rng(3)
    ek = jnp.asarray(rng.standard_normal((1, n, 128)), jnp.bfloat16)
    eb = jnp.asarray(np.where(np.arange(n)[None] <= np.arange(s)[:, None], 0.0, -np.inf)[None],
                     jnp.float32)
    _, bias, _ = block_keys(*args[1:6], 8, ek, eb, None, 64)
    counts = np.asarray(live_blocks(bias.reshape(-1, 64 // h, bias.shape[1]), 64))[:, 0]
    assert bias.shape[1] == 256 and counts.min() == 1 and counts.max() == 3
    fn = functools.partial(chunk_attention_mgpu, window=8, extra_keys=ek, extra_bias=eb,
                           interpret=INTERPRET)
    got = np.asarray(run_kernel(fn, *args).astype(jnp.float32))
    want = kernels_xla.chunk_attention(*args, window=8, extra_keys=ek, extra_bias=eb)
    assert not np.isnan(got).any() and _rel(got, np.asarray(want, np.float32)) < 1e-2


def test_chunk_attention_unsupported_falls_back():
    """Per-token extra keys and decode-sized chunks are served by the XLA reference."""
    from custom_calls.chunk_attention import chunk_attention_mgpu
    args, _ = _chunk(5, 1, 20, 16, 128, 8, 8, 0, [0], [20])
    rng = np.random.default_rng(0)
    per_token = dict(extra_keys=jnp.asarray(rng.standard_normal((1, 20, 3, 128)), jnp.bfloat16),
                     extra_bias=jnp.zeros((1, 20, 3), jnp.float32))
    decode_sized, _ = _chunk(6, 1, 8, 16, 128, 8, 8, 0, [4], [8])
    # A raw query (head norm and rotation still to apply) reaches the reference as it is.
    half = args[0].shape[-1] // 8                 # 2 x 8 rotated channels of 128
    angle = jnp.asarray(rng.uniform(0, 6, (1, 20, half)), jnp.float32)
    raw = dict(q_norm_eps=1e-6, q_rope=(jnp.cos(angle), jnp.sin(angle)))
    for a, kw in ((args, per_token), (decode_sized, {}), (args, {**per_token, **raw})):
        fn = functools.partial(chunk_attention_mgpu, window=8, **kw)
        assert pallas_kernels(fn, *a) == []
        np.testing.assert_array_equal(np.asarray(fn(*a), np.float32), np.asarray(
            kernels_xla.chunk_attention(*a, window=8, **kw), np.float32))
    plain = np.asarray(kernels_xla.chunk_attention(*args, window=8, **per_token), np.float32)
    assert not np.array_equal(plain, np.asarray(chunk_attention_mgpu(
        *args, window=8, **per_token, **raw), np.float32))          # the raw query was used


def test_flash_decode_rejects_tokens_per_cta_that_do_not_fit():
    """Several tokens a CTA need P x H <= 64 rows, P dividing tokens_per_key, one split."""
    from custom_calls.flash_decode import flash_decode
    q = jnp.zeros((16, 32, 128), jnp.bfloat16)
    keys = jnp.zeros((2, 128, 128), jnp.bfloat16)
    bias = jnp.zeros((16, 128), jnp.float32)
    sinks = jnp.zeros((32,), jnp.float32)
    for p, splits in ((4, 1), (3, 1), (2, 2)):     # 128 rows; 3 does not divide 8; 2 splits
        with pytest.raises(ValueError, match="tokens_per_cta"):
            flash_decode(q, keys, bias, sinks, tokens_per_key=8, splits=splits,
                         tokens_per_cta=p, interpret=True)


@pytest.mark.parametrize("b,t,h,d,n", [(2, 70, 32, 128, 100), (1, 64, 16, 64, 64)])
def test_index_scores_interpret(b, t, h, d, n):
    """8 / 16 tokens a CTA, tokens and keys padded to whole tiles."""
    from custom_calls.indexer import index_scores_mgpu
    rng = np.random.default_rng(t + n)
    args = (jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16),
            jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32),
            jnp.asarray(rng.standard_normal((b, n, d)), jnp.bfloat16))
    got = np.asarray(run_kernel(functools.partial(index_scores_mgpu, interpret=INTERPRET), *args))
    want = np.asarray(kernels_xla.index_scores(*args))
    assert got.shape == want.shape == (b, t, n)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_index_scores_decode_falls_back():
    from custom_calls.indexer import index_scores_mgpu
    rng = np.random.default_rng(0)
    args = (jnp.asarray(rng.standard_normal((2, 1, 32, 128)), jnp.bfloat16),
            jnp.asarray(rng.standard_normal((2, 1, 32)), jnp.float32),
            jnp.asarray(rng.standard_normal((2, 40, 128)), jnp.bfloat16))
    assert pallas_kernels(index_scores_mgpu, *args) == []
    np.testing.assert_array_equal(np.asarray(index_scores_mgpu(*args)),
                                  np.asarray(kernels_xla.index_scores(*args)))


def test_prefill_kernels_preferred_on_prefill_chunks_only():
    """chunk_attention and index_scores are chosen by platform preference (not opt-in) for
    prefill chunks at `mini`'s shapes, and decline decode-sized chunks."""
    from custom_calls.chunk_attention import chunk_attention_mgpu
    from custom_calls.indexer import index_scores_mgpu
    sd = jax.ShapeDtypeStruct
    bf = jnp.bfloat16

    def chunk(s, n):
        return ((sd((1, s, 32, 512), bf), sd((1, s, 512), bf), None, None,
                 sd((1, 128, 512), bf), None, None),
                dict(window=128, extra_keys=sd((1, n, 512), bf)))

    def index(t):
        return sd((1, t, 32, 128), bf), sd((1, t, 32), jnp.float32), sd((1, 1024, 128), bf)
    for fn in (chunk_attention_mgpu, index_scores_mgpu):
        assert not getattr(fn, "opt_in", False)
    args, kw = chunk(4096, 1024)
    assert chunk_attention_mgpu.prefers(*args, **kw)
    args, kw = chunk(8, 1024)
    assert not chunk_attention_mgpu.prefers(*args, **kw)
    assert index_scores_mgpu.prefers(*index(4096)) and not index_scores_mgpu.prefers(*index(1))


def test_kernels_lower_for_cuda():
    """Pallas -> Mosaic GPU lowering (layouts, transforms, shared memory) runs on any host."""
    sd = jax.ShapeDtypeStruct
    t0 = time.time()
    jax.export.export(jax.jit(grouped_matmul_mgpu), platforms=["cuda"])(
        sd((6, 2048), jnp.bfloat16), sd((64, 2048, 512), jnp.bfloat16), sd((64,), jnp.int32))
    jax.export.export(jax.jit(sparse_attention_mgpu), platforms=["cuda"])(
        sd((2, 1, 32, 512), jnp.bfloat16), sd((2, 128, 512), jnp.bfloat16),
        sd((2, 1, 128), jnp.float32), sd((2, 1024, 512), jnp.bfloat16),
        sd((2, 1, 512), jnp.int32), sd((32,), jnp.float32))
    from custom_calls.grouped_matmul import grouped_swiglu_mgpu
    for rows in (6, 24576):                                    # mini's decode and 1x4096 prefill
        exported = jax.export.export(jax.jit(functools.partial(grouped_swiglu_mgpu, limit=10.0)),
                                     platforms=["cuda"])(
            sd((rows, 2048), jnp.bfloat16), sd((64, 2048, 512), jnp.bfloat16),
            sd((64, 2048, 512), jnp.bfloat16), sd((64,), jnp.int32))
        assert exported.mlir_module().count("mosaic_gpu") >= 1
    from custom_calls.dense import linear_many_mgpu
    csa_input = [sd((2048, n), jnp.bfloat16) for n in (768, 512, 1024, 1024, 256, 256)]
    exported = jax.export.export(jax.jit(linear_many_mgpu), platforms=["cuda"])(
        sd((16, 2048), jnp.bfloat16), csa_input)
    assert exported.mlir_module().count("mosaic_gpu") >= 1
    from custom_calls.chunk_attention import chunk_attention_mgpu    # mini's CSA prefill

    def csa_chunk(*a, ek, eb, cos, sin):     # the raw query: head norm and rotation inside
        return chunk_attention_mgpu(*a, window=128, extra_keys=ek, extra_bias=eb,
                                    q_norm_eps=1e-6, q_rope=(cos, sin))
    exported = jax.export.export(jax.jit(csa_chunk), platforms=["cuda"])(
        sd((1, 4096, 32, 512), jnp.bfloat16), sd((1, 4096, 512), jnp.bfloat16),
        sd((1,), jnp.int32), sd((1,), jnp.int32), sd((1, 128, 512), jnp.bfloat16),
        sd((1, 128), jnp.int32), sd((32,), jnp.float32), ek=sd((1, 1024, 512), jnp.bfloat16),
        eb=sd((1, 4096, 1024), jnp.float32), cos=sd((1, 4096, 32), jnp.bfloat16),
        sin=sd((1, 4096, 32), jnp.bfloat16))
    assert exported.mlir_module().count("mosaic_gpu") >= 1
    from custom_calls.indexer import index_scores_mgpu             # mini's CSA prefill
    exported = jax.export.export(jax.jit(index_scores_mgpu), platforms=["cuda"])(
        sd((1, 4096, 32, 128), jnp.bfloat16), sd((1, 4096, 32), jnp.float32),
        sd((1, 1024, 128), jnp.bfloat16))
    assert exported.mlir_module().count("mosaic_gpu") >= 1
    assert time.time() - t0 < 40


@pytest.mark.parametrize("m,split", [(1, {}), (6, {"splits": 2}), (13, {"splits": 4}),
                                     (64, {"splits": 2, "block_n": 64})])
def test_linear_kernels_interpret(m, split):
    """`linear` / `grouped_linear` on the split-K decode GEMM (rows padded to 8, K split in
    2 or 4 partial products), bf16, against the XLA reference; the kernel must have run."""
    from custom_calls.dense import grouped_linear_mgpu, linear_mgpu
    from deepinfer_fn.model.common import grouped_linear_xla, linear_xla
    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.standard_normal((m, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((256, 192)) / 16, jnp.bfloat16)
    fn = functools.partial(linear_mgpu, interpret=INTERPRET, **split)
    got = np.asarray(run_kernel(fn, x, w).astype(jnp.float32))
    np.testing.assert_allclose(got, np.asarray(linear_xla(x, w).astype(jnp.float32)),
                               rtol=2e-2, atol=2e-2)
    xg = jnp.asarray(rng.standard_normal((m, 2, 256)), jnp.bfloat16)
    wg = jnp.asarray(rng.standard_normal((2, 256, 128)) / 16, jnp.bfloat16)
    fn = functools.partial(grouped_linear_mgpu, interpret=INTERPRET, **split)
    got = np.asarray(run_kernel(fn, xg, wg).astype(jnp.float32))
    np.testing.assert_allclose(got, np.asarray(grouped_linear_xla(xg, wg).astype(jnp.float32)),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("m,split", [(1, {}), (13, {"splits": 2}), (64, {"block_n": 64})])
def test_linear_many_one_launch_interpret(m, split):
    """`linear_many`: the weights the kernel fits (64-multiple widths, one dtype) in one
    launch, bf16, each against its XLA `linear`; a 32-wide one goes through `linear`."""
    from custom_calls.dense import linear_many_mgpu, linear_many_prefers
    from deepinfer_fn.model.common import linear_xla
    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.standard_normal((m, 256)), jnp.bfloat16)
    ws = [jnp.asarray(rng.standard_normal((256, n)) / 16, jnp.bfloat16)
          for n in (192, 64, 32, 128)]
    fn = functools.partial(linear_many_mgpu, interpret=INTERPRET, **split)
    assert len(pallas_kernels(fn, x, ws)) == 1
    got = run_kernel(fn, x, ws)
    for y, w in zip(got, ws):
        np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)),
                                   np.asarray(linear_xla(x, w).astype(jnp.float32)),
                                   rtol=2e-2, atol=2e-2)
    assert linear_many_prefers(x, ws)
    assert not linear_many_prefers(x, ws[2:3] + ws[:1])          # one fits: `linear` does it
    assert not linear_many_prefers(jnp.zeros((65, 256), jnp.bfloat16), ws)


def test_linear_many_model_path_uses_one_launch():
    """The model's `linear_many` under the forced kernel equals separate projections and
    launches one kernel for the fitting weights."""
    from deepinfer_fn import kernels as k
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 1, 128)), jnp.bfloat16)
    ws = [jnp.asarray(rng.standard_normal((128, n)) / 16, jnp.bfloat16) for n in (64, 128)]
    want = [k.linear(x, w) for w in ws]
    if INTERPRET:
        from jax.experimental.pallas import mosaic_gpu as plgpu
        ctx = plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams())
    else:
        import contextlib
        ctx = contextlib.nullcontext()
    with k.use("linear_many", "mosaic_gpu"), ctx:
        assert len(pallas_kernels(k.linear_many, x, ws)) == 1
        got = k.linear_many(x, ws)
    for y, w in zip(got, want):
        assert y.shape == w.shape
        np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(w, np.float32),
                                   rtol=2e-2, atol=2e-2)


def test_linear_kernels_prefer_decode_rows_only():
    """Taken for <= 64 rows of 64-aligned bf16 weights; more rows, odd shapes and fp32 go to
    XLA (and a forced call on them runs the reference, no kernel)."""
    from custom_calls.dense import linear_mgpu, linear_prefers
    w = jnp.zeros((128, 192), jnp.bfloat16)
    assert linear_prefers(jnp.zeros((64, 128), jnp.bfloat16), w)
    assert not linear_prefers(jnp.zeros((65, 128), jnp.bfloat16), w)
    assert not linear_prefers(jnp.zeros((1, 96), jnp.bfloat16), jnp.zeros((96, 192), jnp.bfloat16))
    assert not linear_prefers(jnp.zeros((1, 128), jnp.float32), w.astype(jnp.float32))
    odd = (jnp.ones((2, 96), jnp.bfloat16), jnp.ones((96, 64), jnp.bfloat16))
    assert pallas_kernels(linear_mgpu, *odd) == []


def test_decode_gemm_benchmark_smoke(tmp_path):
    """benchmarks/decode_gemm.py --quick: every variant's output checked against XLA (interpret
    mode), the planned tiles first; the variants respect the K split and shared memory."""
    from benchmarks import decode_gemm
    out = decode_gemm.main(["--quick", "--batches", "3", "--variants", "2", "--reps", "1",
                            "--out", str(tmp_path / "r.json")])
    assert [r["shape"] for r in out["rows"]] == ["tiny", "tiny many"]
    for row in out["rows"]:
        assert len(row["tiles"]) == 2 and row["planned_us"] == row["tiles"][0]["us"]
        assert all(t["max_abs_err"] < 2e-2 for t in row["tiles"]), row["tiles"]
    for name, k, widths in decode_gemm.MINI_SHAPES:
        for cfg in decode_gemm.variants(k, widths, 132):
            assert k // cfg["block_k"] % cfg["splits"] == 0
            assert cfg["stages"] <= k // cfg["block_k"] // cfg["splits"]
            assert all(w % cfg["block_n"] == 0 for w in widths)


def test_prefill_kernels_benchmark_smoke(tmp_path):
    """benchmarks/prefill_kernels.py end to end on the tiny preset (both arms XLA on a CPU)."""
    from benchmarks import prefill_kernels
    rows = prefill_kernels.main(["--preset", "tiny", "--shapes", "1x32", "--peak-n", "128",
                                 "--out", str(tmp_path / "pk.json")])["rows"]
    assert [r["arm"] for r in rows] == ["kernels", "xla"]
    assert rows[0]["logits_sum"] == rows[1]["logits_sum"] and all(r["ms"] > 0 for r in rows)
    assert rows[1]["logits_rel_err"] == 0.0 and rows[1]["top1_agreement"] == 1.0
    one = prefill_kernels.main(["--preset", "tiny", "--shapes", "1x32", "--peak-n", "128",
                                "--arms", "kernels", "--ops", "index_scores",
                                "--out", str(tmp_path / "pk1.json")])["rows"]
    assert one[0]["ops"] == ["index_scores"]
    with pytest.raises(SystemExit):
        prefill_kernels.main(["--ops", "no_such_op", "--out", str(tmp_path / "x.json")])
    from benchmarks.prefill_kernels import agreement
    a = jnp.asarray([[1.0, 2.0], [3.0, 0.0]])
    got = agreement(a, jnp.asarray([[1.0, 2.0], [0.0, 3.0]]))
    assert got["top1_agreement"] == 0.5 and got["logits_rel_err"] == pytest.approx((18 / 14) ** 0.5)


def test_linear_many_rejects_mismatched_weights():
    """A weight whose rows are not the input's width is named in the error (XLA and kernel
    paths alike: the check is before the registry call)."""
    from deepinfer_fn import kernels as k
    x = jnp.zeros((2, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"\(96, 64\)"):
        k.linear_many(x, [jnp.zeros((128, 64), jnp.bfloat16), jnp.zeros((96, 64), jnp.bfloat16)])
