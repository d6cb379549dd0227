"""Public API: forward's contract, input errors, dtype modes (bf16 vs fp32 error report)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deepinfer_fn as di
from conftest import GOLDEN, golden_params, rel_err


def test_public_names():
    for name in ("ModelConfig", "init_params", "load_params", "forward"):
        assert hasattr(di, name)


def test_params_are_a_pytree_with_static_config():
    params = golden_params("cfg_a")
    leaves, treedef = jax.tree.flatten(params)
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert rebuilt.config == params.config
    assert all(isinstance(x, jax.Array) for x in leaves)


@pytest.mark.parametrize("tokens,error,message", [
    (np.zeros((3,), np.int32), ValueError, "2-D"),
    (np.zeros((1, 0), np.int32), ValueError, "empty"),
    (np.zeros((1, 4), np.float32), TypeError, "integer"),
    (np.array([[1, 2, 256]], np.int32), ValueError, r"outside the vocabulary \[0, 256\): \[256\]"),
    (np.array([[-1, 2]], np.int32), ValueError, "outside the vocabulary"),
    (np.zeros((1, 1025), np.int32), ValueError, "max_position_embeddings"),
])
def test_bad_tokens_raise(tokens, error, message):
    with pytest.raises(error, match=message):
        di.forward(golden_params("cfg_a"), tokens)


def test_batch_rows_are_independent(golden):
    """Row b of a batch equals the same prompt alone (no cross-row leakage)."""
    ref, params = golden("cfg_a"), golden_params("cfg_a")
    one = np.asarray(di.forward(params, ref["input_ids"][1:2]))
    np.testing.assert_allclose(one[0], ref["logits"][1], rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", ["cfg_a", "cfg_b", "cfg_c"])
def test_bf16_forward_error_against_fp32(name, golden):
    """Serving dtype: bf16 weights/activations, fp32 statistics, softmax and accumulation.

    The error is dominated by discrete decisions (router / indexer top-k) that bf16 noise
    flips at a few positions; the bulk stays at bf16 rounding through the stack.
    """
    ref = golden(name)
    params = di.load_params(GOLDEN / name, dtype=jnp.bfloat16)
    logits = np.asarray(di.forward(params, ref["input_ids"]))
    want = ref["logits"]
    assert logits.dtype == np.float32 and np.all(np.isfinite(logits))
    diff = np.abs(logits - want)
    mean_rel = diff.mean() / np.abs(want).mean()
    p99 = np.quantile(diff, 0.99) / np.abs(want).max()
    top1 = float(np.mean(logits.argmax(-1) == want.argmax(-1)))
    print(f"\nBF16 {name}: max {rel_err(logits, want):.2e}, p99 {p99:.2e} (of max|logit|), "
          f"mean {mean_rel:.2e} (of mean|logit|), top-1 agreement {top1:.3f}")
    assert mean_rel < 0.03 and p99 < 0.03 and top1 > 0.95
