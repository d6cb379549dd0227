"""Dense `attention` Mosaic GPU kernel (custom_calls/attention.py) against the XLA reference.

The kernel runs under Pallas' GPU interpret mode on the CPU (natively on a Hopper GPU) with
bf16 operands (bias and sinks fp32, as the contract says); each test proves the kernel ran
(`run_kernel`: a Pallas launch in the jaxpr, in interpret mode off the GPU). The reference
is the public `kernels.attention` under `kernels.use("attention", "xla")`. Lowering for
CUDA is checked on the V4 head geometry (H=32, d=512) without a GPU.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_fn import kernels
from test_kernels_gpu import INTERPRET, pallas_kernels, run_kernel

try:
    from custom_calls import _common
    from custom_calls.attention import MAX_TOKENS, attention_mgpu
    _IMPORT_ERROR = None
except ImportError as e:  # pragma: no cover - depends on the installed JAX
    _IMPORT_ERROR = e

pytestmark = pytest.mark.skipif(
    _IMPORT_ERROR is not None or not _common.interpret_available(),
    reason=f"Pallas Mosaic GPU interpret mode unavailable in this JAX: {_IMPORT_ERROR}")


def _inputs(seed, b, t, h, d, s, dtype=jnp.bfloat16, keep=0.8):
    """q [B,T,H,d], keys [B,S,d], bias [B,T,S] (0 / -inf, the last T keys causal), sinks [H]."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), dtype)
    keys = jnp.asarray(rng.standard_normal((b, s, d)), dtype)
    vis = rng.random((b, t, s)) < keep
    vis[:, :, s - t:] &= np.tril(np.ones((t, t), bool))[None]   # the chunk's own keys: causal
    bias = jnp.asarray(np.where(vis, 0.0, -np.inf), jnp.float32)
    sinks = jnp.asarray(rng.standard_normal(h), jnp.float32)
    return q, keys, bias, sinks


def _reference(*args):
    with kernels.use("attention", "xla"):
        return kernels.attention(*args)


def _check(args, **kw):
    got = run_kernel(functools.partial(attention_mgpu, interpret=INTERPRET, **kw), *args)
    want = _reference(*args)
    assert got.shape == want.shape and got.dtype == want.dtype == jnp.bfloat16
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert not np.isnan(got).any()
    rel = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert rel < 1e-2, rel
    return got


def test_registered():
    assert "mosaic_gpu" in kernels.implementations("attention")
    assert kernels.implementation("attention", "mosaic_gpu") is attention_mgpu
    assert attention_mgpu.available() is (not INTERPRET)
    assert attention_mgpu.opt_in                       # chosen only when forced
    assert kernels.choose("attention", "gpu") == "xla"


@pytest.mark.parametrize("b,h,d,s,splits", [
    (2, 8, 128, 129, None),     # SWA decode: 128 ring slots + 1 new key (padded to 136 rows)
    (1, 16, 256, 161, 3),       # HCA decode: + 32 compressed rows; 3 key splits merged
])
def test_decode(b, h, d, s, splits):
    _check(_inputs(b + h + s, b, 1, h, d, s), splits=splits)


def test_verify_chunk():
    """T=4 speculative verify, B=2: the 4 query tokens of a sequence share its keys."""
    _check(_inputs(4, 2, 4, 8, 128, 72))


def test_fully_masked_row_gives_zero():
    """A token that sees no key: only the sink is left, so its output is zero."""
    q, keys, bias, sinks = _inputs(5, 1, 2, 8, 128, 72)
    bias = bias.at[0, 0].set(-jnp.inf)
    got = _check((q, keys, bias, sinks))
    np.testing.assert_array_equal(got[0, 0], 0.0)
    assert np.abs(got[0, 1]).max() > 0


def test_short_key_list():
    """S < one key block (block_k = 64): the copy engine zero-fills the rest of the block."""
    _check(_inputs(6, 1, 1, 8, 128, 40))


def test_unsupported_falls_back_to_reference():
    prefill = _inputs(7, 1, MAX_TOKENS + 16, 8, 128, 48)         # a prefill tile
    fp32 = _inputs(8, 1, 1, 8, 128, 64, dtype=jnp.float32)
    odd_heads = _inputs(9, 1, 1, 4, 128, 64)                     # H not a multiple of 8
    for args in (prefill, fp32, odd_heads):
        assert pallas_kernels(attention_mgpu, *args) == []
        np.testing.assert_array_equal(np.asarray(attention_mgpu(*args), np.float32),
                                      np.asarray(_reference(*args), np.float32))


@pytest.mark.parametrize("b,t,s", [(2, 1, 129), (16, 1, 161), (2, 4, 132), (1, MAX_TOKENS, 400)])
def test_lowers_for_cuda(b, t, s):
    """Pallas -> Mosaic GPU lowering (layouts, TMA tiling, shared memory) at V4's H=32, d=512."""
    sd = jax.ShapeDtypeStruct
    exported = jax.export.export(jax.jit(attention_mgpu), platforms=["cuda"])(
        sd((b, t, 32, 512), jnp.bfloat16), sd((b, s, 512), jnp.bfloat16),
        sd((b, t, s), jnp.float32), sd((32,), jnp.float32))
    assert "mosaic_gpu" in exported.mlir_module()
