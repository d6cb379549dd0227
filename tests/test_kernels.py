"""Kernel registry: dispatch, overrides, unavailable backends, and every registered
implementation against the XLA reference (a brute-force loop for the reference itself)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_fn import kernels
from test_kernels_gpu import pallas_kernels


def _grouped_inputs(seed=0, m=40, k=16, n=24, g=5):
    rng = np.random.default_rng(seed)
    sizes = rng.multinomial(m - 3, np.ones(g) / g).astype(np.int32)  # 3 padding rows at the end
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((g, k, n)).astype(np.float32)
    return x, w, sizes


def test_grouped_matmul_reference_against_loop():
    x, w, sizes = _grouped_inputs()
    got = np.asarray(kernels.grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes)))
    start = 0
    for gi, s in enumerate(sizes):
        np.testing.assert_allclose(got[start:start + s], x[start:start + s] @ w[gi], rtol=1e-5, atol=1e-5)
        start += s
    np.testing.assert_array_equal(got[start:], 0.0)


def test_attention_reference_against_loop():
    rng = np.random.default_rng(1)
    b, t, h, d, s = 2, 3, 4, 8, 6
    q = rng.standard_normal((b, t, h, d)).astype(np.float32)
    keys = rng.standard_normal((b, s, d)).astype(np.float32)
    mask = rng.random((b, t, s)) < 0.7
    mask[..., 0] = True
    bias = np.where(mask, 0.0, -np.inf).astype(np.float32)
    sinks = rng.standard_normal(h).astype(np.float32)
    got = np.asarray(kernels.attention(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(bias), jnp.asarray(sinks)))
    for bi in range(b):
        for ti in range(t):
            for hi in range(h):
                vis = np.flatnonzero(mask[bi, ti])
                logits = keys[bi, vis] @ q[bi, ti, hi] / np.sqrt(d)
                z = np.exp(logits - logits.max())
                denom = z.sum() + np.exp(sinks[hi] - logits.max())
                want = (z / denom) @ keys[bi, vis]
                np.testing.assert_allclose(got[bi, ti, hi], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", ["grouped_matmul", "attention"])
def test_every_op_has_reference_and_dispatch_points(op):
    impls = kernels.implementations(op)
    assert "xla" in impls and "sm100" in impls and "ascend" in impls
    assert kernels.choose(op, "cpu") == "xla"


@pytest.mark.parametrize("impl,message", [("sm100", "SM100"), ("ascend", "CANN 9.2")])
def test_unbuilt_backends_fail_clearly(impl, message):
    x, w, sizes = _grouped_inputs()
    with kernels.use("grouped_matmul", impl):
        with pytest.raises(kernels.KernelUnavailable, match=message):
            kernels.grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes))
    assert kernels.choose("grouped_matmul", "cpu") == "xla"


def test_unknown_override_is_rejected(monkeypatch):
    with pytest.raises(kernels.KernelUnavailable, match="no implementation 'cutlass'"):
        with kernels.use("grouped_matmul", "cutlass"):
            pass
    monkeypatch.setenv("DEEPINFER_KERNELS", "attention=cutlass")
    with pytest.raises(kernels.KernelUnavailable, match="no implementation 'cutlass'"):
        kernels.choose("attention")


def test_gpu_kernels_match_reference_in_interpret_mode():
    """Mosaic GPU grouped_matmul (when registered) vs XLA, via Pallas' GPU interpreter, in bf16
    (fp32 operands would be served by the XLA reference); the jaxpr must hold the interpret-mode
    kernel. tests/test_kernels_gpu.py and tests/test_kernel_*.py cover every kernel."""
    if "mosaic_gpu" not in kernels.implementations("grouped_matmul"):
        pytest.skip("no Mosaic GPU grouped_matmul registered in this build")
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    x, w, sizes = _grouped_inputs(m=256, k=128, n=128, g=4)
    x, w, sizes = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), jnp.asarray(sizes)
    fn = functools.partial(kernels.implementation("grouped_matmul", "mosaic_gpu"), interpret=True)
    launches = pallas_kernels(fn, x, w, sizes)
    assert launches and all(launches), f"the kernel did not run in interpret mode: {launches}"
    want = kernels.implementation("grouped_matmul", "xla")(x, w, sizes).astype(jnp.float32)
    got = fn(x, w, sizes).astype(jnp.float32)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-1)


def test_prefers_sends_declined_shapes_to_the_reference(monkeypatch):
    """An implementation's `prefers` decides per call under the platform preference (declined:
    the XLA reference runs); a forced choice runs whatever `prefers` says."""
    from deepinfer_fn import kernel_registry as reg
    op = "test_prefers_op"
    ran = []
    monkeypatch.setitem(reg._REGISTRY, op, {})          # removed again at teardown
    reg.register(op, "xla")(lambda x: ran.append("xla") or x)
    fast = reg.register(op, "fast")(lambda x: ran.append("fast") or x)
    fast.prefers = lambda x: x.shape[0] <= 4
    monkeypatch.setitem(reg._PREFERENCE, jax.default_backend(), ("fast", "xla"))
    small, big = jnp.zeros((4,)), jnp.zeros((5,))
    assert reg.chosen_for(op, small) == "fast" and reg.chosen_for(op, big) == "xla"
    reg.call(op, small), reg.call(op, big)
    with reg.use(op, "fast"):
        assert reg.chosen_for(op, big) == "fast"
        reg.call(op, big)
    assert ran == ["fast", "xla", "fast"]


@pytest.mark.parametrize("m", [1, 5])
def test_linear_reference_against_numpy(m):
    """`linear` / `grouped_linear` (XLA): a single row (run as two rows, `two_rows`) and
    several rows against numpy products, leading axes kept."""
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, 1, 24)).astype(np.float32)
    w = rng.standard_normal((24, 40)).astype(np.float32)
    got = np.asarray(kernels.linear(jnp.asarray(x), jnp.asarray(w)))
    assert got.shape == (m, 1, 40)
    np.testing.assert_allclose(got, x @ w, rtol=1e-5, atol=1e-5)
    xg = rng.standard_normal((m, 3, 16)).astype(np.float32)
    wg = rng.standard_normal((3, 16, 8)).astype(np.float32)
    got = np.asarray(kernels.grouped_linear(jnp.asarray(xg), jnp.asarray(wg)))
    np.testing.assert_allclose(got, np.einsum("ngi,gir->ngr", xg, wg), rtol=1e-5, atol=1e-5)


def test_single_row_projection_stays_a_dot():
    """The single-row case is lowered as a dot of two rows, never a [1, K] x [K, N] dot
    (which XLA:GPU rewrites into an unfused multiply + column reduction)."""
    x = jnp.ones((1, 64), jnp.bfloat16)
    w = jnp.ones((64, 32), jnp.bfloat16)
    dots = [ln for ln in jax.jit(kernels.linear).lower(x, w).as_text().splitlines()
            if "dot_general" in ln]
    assert len(dots) == 1 and "(tensor<2x64xbf16>, tensor<64x32xbf16>)" in dots[0], dots
