"""mHC registry ops (`mhc_pre`, `mhc_post`, spec §2.3): the XLA reference against the model's
per-step functions, and the Mosaic GPU kernels (custom_calls/mhc.py) against the reference in
Pallas' GPU interpret mode on CPU with bf16 inputs, plus their lowering for CUDA."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_fn import kernels, kernels_xla
from deepinfer_fn.config import ModelConfig
from deepinfer_fn.model import mhc
from deepinfer_fn.model.common import rms_norm

try:
    from custom_calls import _common
    from custom_calls.mhc import mhc_post_mgpu, mhc_pre_mgpu, sinkhorn_mgpu
    _IMPORT_ERROR = None
except ImportError as e:  # pragma: no cover - depends on the installed JAX
    _IMPORT_ERROR = e

needs_interpret = pytest.mark.skipif(
    _IMPORT_ERROR is not None or not _common.interpret_available(),
    reason=f"Pallas Mosaic GPU interpret mode unavailable in this JAX: {_IMPORT_ERROR}")

KW = dict(iters=20, hc_eps=1e-6, norm_eps=1e-6)


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _inputs(seed, ntok, d, dtype, n=4):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((ntok, n, d)), dtype)
    fn = jnp.asarray(rng.standard_normal((n * d, (2 + n) * n)) * (2.0 / np.sqrt(n * d)),
                     jnp.float32)
    base = jnp.asarray(rng.standard_normal((2 + n) * n) * 0.5, jnp.float32)
    scale = jnp.asarray([0.8, 1.1, 1.5], jnp.float32)
    w = jnp.asarray(1.0 + 0.1 * rng.standard_normal(d), dtype)
    y = jnp.asarray(rng.standard_normal((ntok, d)), dtype)
    return x, fn, base, scale, w, y


def test_xla_reference_is_the_model_math():
    x, fn, base, scale, w, y = _inputs(0, 6, 16, jnp.float32)
    h, post, comb = kernels.mhc_pre(x, fn, base, scale, w, **KW)
    pre, post0, comb0 = mhc.mhc_weights(x, fn, base, scale, n=4, **KW)
    np.testing.assert_allclose(h, rms_norm(mhc.collapse(x, pre), w, 1e-6), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(post, post0, rtol=1e-6)
    np.testing.assert_allclose(comb, comb0, rtol=1e-6)
    np.testing.assert_allclose(kernels.mhc_post(x, y, post, comb), mhc.expand(x, y, post, comb),
                               rtol=1e-6, atol=1e-6)


def test_sublayer_helpers_keep_leading_axes():
    cfg = ModelConfig.preset("tiny")
    n, d = cfg.hc_mult, cfg.hidden_size
    x, fn, base, scale, w, _ = _inputs(1, 6, d, jnp.float32, n)
    streams = x.reshape(2, 3, n, d)
    hc = {"fn": fn, "base": base, "scale": scale}
    h, post, comb = mhc.sublayer_pre(hc, w, streams, cfg)
    assert h.shape == (2, 3, d) and post.shape == (2, 3, n) and comb.shape == (2, 3, n, n)
    out = mhc.sublayer_post(streams, 2 * h, post, comb)
    np.testing.assert_allclose(out, mhc.expand(streams, 2 * h, post, comb), rtol=1e-6, atol=1e-6)


def test_registered_and_preferred():
    """The mHC kernels are in the GPU preference where an sm_90 device is available: the pre
    side (and the Sinkhorn) at every supported width, the post side for n * D <= 1024 and at
    least 128 tokens only; forcing them works at any width."""
    from custom_calls.mhc import mhc_pre_prefers, mhc_prefers
    for op, prefers in (("mhc_pre", mhc_pre_prefers), ("mhc_post", mhc_prefers),
                        ("sinkhorn", None)):
        fn = kernels.implementation(op, "mosaic_gpu")
        assert {"xla", "mosaic_gpu", "sm100", "ascend"} <= set(kernels.implementations(op))
        assert not getattr(fn, "opt_in", False) and getattr(fn, "prefers", None) is prefers
        assert kernels.choose(op, "cpu") == "xla"
        assert kernels.choose(op, "gpu") == ("mosaic_gpu" if fn.available() else "xla")
        with kernels.use(op, "mosaic_gpu"):
            assert kernels.choose(op, "gpu") == "mosaic_gpu"
    narrow, wide = jnp.zeros((16, 4, 256), jnp.bfloat16), jnp.zeros((16, 4, 2048), jnp.bfloat16)
    many = jnp.zeros((2, 64, 4, 256), jnp.bfloat16)       # [B, T, n, D]: 128 tokens
    assert mhc_prefers(many) and not mhc_prefers(narrow) and not mhc_prefers(wide)
    assert mhc_pre_prefers(narrow) and mhc_pre_prefers(wide)
    for f in (mhc_prefers, mhc_pre_prefers):
        assert not f(narrow.astype(jnp.float32))          # unsupported: never preferred


def _ran_kernel(fn, *args) -> bool:
    """The traced program holds a Pallas kernel (plgpu.kernel binds mpmd_map in this JAX)."""
    text = str(jax.make_jaxpr(fn)(*args))
    return "pallas_call" in text or "mpmd_map" in text


def _pre(x, fn, base, scale, w):
    return mhc_pre_mgpu(x, fn, base, scale, w, interpret=True, path="one", **KW)


def _post(x, y, post, comb):
    return mhc_post_mgpu(x, y, post, comb, interpret=True)


@needs_interpret
@pytest.mark.parametrize("ntok,d", [(1, 128), (16, 256), (130, 128)])
def test_mhc_kernels_interpret(ntok, d):
    """Decode (one CTA, rows past N) and a prefill tile with a remainder (3 CTAs)."""
    x, fn, base, scale, w, y = _inputs(ntok + d, ntok, d, jnp.bfloat16)
    assert _ran_kernel(_pre, x, fn, base, scale, w)
    h, post, comb = _pre(x, fn, base, scale, w)
    h0, post0, comb0 = kernels_xla.mhc_pre(x, fn, base, scale, w, **KW)
    assert h.dtype == jnp.bfloat16 and h.shape == h0.shape
    assert _rel(h, h0) < 1e-2
    np.testing.assert_allclose(post, post0, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(comb, comb0, rtol=1e-4, atol=1e-5)

    assert _ran_kernel(_post, x, y, post0, comb0)
    out = _post(x, y, post0, comb0)
    want = kernels_xla.mhc_post(x, y, post0, comb0)
    assert out.dtype == jnp.bfloat16
    assert _rel(out, want) < 1e-3   # same bf16 roundings as the reference


@needs_interpret
@pytest.mark.parametrize("ntok,d,splits", [(1, 256, 2), (16, 256, 4), (130, 128, 2)])
def test_mhc_pre_split_d_interpret(ntok, d, splits):
    """The wide-stream pre side: partial mixing sums over column slices (one CTA each), then
    gates and collapse per column split; against the XLA reference."""
    x, fn, base, scale, w, _ = _inputs(ntok + d + splits, ntok, d, jnp.bfloat16)
    pre = functools.partial(mhc_pre_mgpu, interpret=True, path="split", splits=splits, **KW)
    text = str(jax.make_jaxpr(pre)(x, fn, base, scale, w))
    assert text.count("mpmd_map") + text.count("pallas_call") >= 2      # both kernels ran
    h, post, comb = pre(x, fn, base, scale, w)
    h0, post0, comb0 = kernels_xla.mhc_pre(x, fn, base, scale, w, **KW)
    assert h.dtype == jnp.bfloat16 and _rel(h, h0) < 1e-2
    np.testing.assert_allclose(post, post0, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(comb, comb0, rtol=1e-4, atol=1e-5)


@needs_interpret
@pytest.mark.parametrize("ntok", [1, 70])
def test_sinkhorn_kernel_interpret(ntok):
    """The Sinkhorn kernel against the unrolled XLA form, on logits of a wide range (peaked
    rows)."""
    logits = jnp.asarray(np.random.default_rng(ntok).standard_normal((ntok, 4, 4)) * 4,
                         jnp.float32)
    assert _ran_kernel(functools.partial(sinkhorn_mgpu, iters=20, eps=1e-6, interpret=True),
                       logits)
    got = sinkhorn_mgpu(logits, iters=20, eps=1e-6, interpret=True)
    np.testing.assert_allclose(got, kernels_xla.sinkhorn(logits, iters=20, eps=1e-6),
                               rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(got).sum(axis=1), 1.0, atol=1e-4)   # columns


@needs_interpret
@pytest.mark.parametrize("ntok", [1, 70])
def test_hybrid_pre_side_interpret(ntok):
    """The pre side's hybrid path (XLA projection, affine map, collapse and norm; one kernel
    for the sigmoids and the Sinkhorn) against the reference. The projection scales its
    outputs by the RMS factor instead of its inputs: gates equal to fp32 rounding, h to bf16
    rounding (a gate's last bit can move an element of h across a rounding boundary)."""
    from custom_calls.mhc import _hybrid_gates
    x, fn, base, scale, w, _ = _inputs(ntok, ntok, 128, jnp.bfloat16)
    # References first: an eager XLA call issued while an interpret-mode kernel's callbacks
    # are still in flight can starve them on a 2-core host.
    h0, post0, comb0 = jax.block_until_ready(kernels_xla.mhc_pre(x, fn, base, scale, w, **KW))
    pre0 = jax.block_until_ready(mhc.mhc_weights(x, fn, base, scale, n=4, **KW)[0])
    hyb = functools.partial(mhc_pre_mgpu, interpret=True, path="hybrid", **KW)
    assert str(jax.make_jaxpr(hyb)(x, fn, base, scale, w)).count("mpmd_map") == 1
    h, post, comb = jax.block_until_ready(hyb(x, fn, base, scale, w))
    gt = jax.block_until_ready(_hybrid_gates(x, fn, base, scale, n=4, iters=20, hc_eps=1e-6,
                                             norm_eps=1e-6, interpret=True))
    np.testing.assert_allclose(post, post0, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(comb, comb0, rtol=1e-5, atol=1e-6)
    assert h.dtype == jnp.bfloat16 and h.shape == h0.shape
    assert _rel(h, h0) < 2e-3
    differ = np.asarray(h, np.float32) != np.asarray(h0, np.float32)
    assert differ.mean() < 0.01, differ.mean()
    assert gt.shape == (24, 64 * -(-ntok // 64))
    np.testing.assert_allclose(np.asarray(gt)[:4, :ntok].T, pre0, rtol=1e-5, atol=1e-6)


def test_pre_path_choice():
    from custom_calls.mhc import choose_mix_splits, choose_pre_path
    assert choose_pre_path(128, 4, 256) == "one" and choose_pre_path(127, 4, 256) == "hybrid"
    assert choose_pre_path(64, 4, 2048) == "hybrid" and choose_pre_path(4096, 4, 2048) == "split"
    assert choose_mix_splits(64, 32) == 2 and choose_mix_splits(1, 64) == 32
    with pytest.raises(ValueError, match="path"):
        x, fn, base, scale, w, _ = _inputs(0, 2, 64, jnp.bfloat16)
        mhc_pre_mgpu(x, fn, base, scale, w, path="nope", **KW)


def test_sinkhorn_op_checks_shapes():
    with pytest.raises(ValueError, match="sinkhorn"):
        kernels.sinkhorn(jnp.zeros((3, 4, 2)), iters=20, eps=1e-6)


def test_prepared_weights_keep_fp32_precision():
    """The kernel's [hi | lo] bf16 halves of fn reproduce it to 2^-16 relative."""
    from custom_calls.mhc import GATES, prepare_fn
    fn = _inputs(3, 1, 64, jnp.bfloat16)[1]
    f = np.asarray(prepare_fn(fn).astype(jnp.float32))
    back = f[:, :24] + f[:, GATES:GATES + 24]
    assert np.all(np.abs(back - np.asarray(fn)) <= 2.0 ** -16 * np.abs(np.asarray(fn)))
    assert np.all(f[:, 24:GATES] == 0) and np.abs(f[:, GATES:]).max() > 0


def test_unsupported_falls_back_to_reference():
    x, fn, base, scale, w, y = _inputs(2, 3, 64, jnp.float32)   # fp32 streams
    assert not _ran_kernel(functools.partial(mhc_pre_mgpu, **KW), x, fn, base, scale, w)
    got = mhc_pre_mgpu(x, fn, base, scale, w, **KW)
    want = kernels_xla.mhc_pre(x, fn, base, scale, w, **KW)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(mhc_post_mgpu(x, y, want[1], want[2])),
                                  np.asarray(kernels_xla.mhc_post(x, y, want[1], want[2])))


@needs_interpret
@pytest.mark.parametrize("path,kernels", [("one", 1), ("split", 2), ("hybrid", 1)])
def test_mhc_kernels_lower_for_cuda(path, kernels):
    """Pallas -> Mosaic GPU lowering (layouts, transforms, shared memory) on a mini-sized D,
    each pre-side path with its own kernels."""
    sd = jax.ShapeDtypeStruct
    n, d, ntok = 4, 2048, 65
    pre = jax.export.export(jax.jit(functools.partial(mhc_pre_mgpu, path=path, splits=4, **KW)),
                            platforms=["cuda"])(
        sd((ntok, n, d), jnp.bfloat16), sd((n * d, 24), jnp.float32), sd((24,), jnp.float32),
        sd((3,), jnp.float32), sd((d,), jnp.bfloat16))
    assert pre.mlir_module().count("stablehlo.custom_call @mosaic_gpu") == kernels
    post = jax.export.export(jax.jit(mhc_post_mgpu), platforms=["cuda"])(
        sd((ntok, n, d), jnp.bfloat16), sd((ntok, d), jnp.bfloat16), sd((ntok, n), jnp.float32),
        sd((ntok, n, n), jnp.float32))
    for e in (pre, post):
        assert "mosaic_gpu" in e.mlir_module()


@needs_interpret
def test_mhc_call_sites_share_one_lowering():
    """Three layers' call sites of one shape lower one Mosaic kernel a side (each side's
    kernel is a jitted callee, which JAX lowers once per program): the exported module holds
    as many Mosaic custom calls as a single call site's."""
    sd = jax.ShapeDtypeStruct
    n, d, ntok = 4, 256, 16
    args = (sd((ntok, n, d), jnp.bfloat16), sd((n * d, 24), jnp.float32), sd((24,), jnp.float32),
            sd((3,), jnp.float32), sd((d,), jnp.bfloat16))

    def layers(count):
        def f(x, fn, base, scale, w):
            for _ in range(count):
                h, post, comb = mhc_pre_mgpu(x, fn, base, scale, w, **KW)
                x = mhc_post_mgpu(x, h, post, comb)
            return x
        text = jax.export.export(jax.jit(f), platforms=["cuda"])(*args).mlir_module()
        return text.count("stablehlo.custom_call @mosaic_gpu")

    one, three = layers(1), layers(3)
    assert one >= 2 and three == one, (one, three)
