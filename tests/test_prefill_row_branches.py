"""A prefill chunk of a layer with compressed (or V4.1 token) rows attends under one of two
forms: every row with the unselected ones masked (the rows buffer holds at most
`DENSE_ROWS_MAX` rows) or each token's selected rows gathered (a larger buffer). The two are
the same attention: logits and state agree, V4 and V4.1, in float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deepinfer_fn as di
from deepinfer_fn.model import cached, cached_v41, transformer


def _prefill(params, state, ids, n_new):
    logits, new_state, _ = transformer.forward_chunk(params, state, ids, n_new,
                                                     all_logits=True)
    return logits, new_state


@pytest.mark.parametrize("preset", ["tiny", "v4.1-tiny"])
def test_gathered_rows_equal_masked_rows(preset, monkeypatch):
    cfg = di.ModelConfig.preset(preset)
    params = di.init_params(cfg, jax.random.key(1))
    batch, tokens = 2, 40                      # > DECODE_CHUNK_MAX: the blocked prefill path
    ids = jax.random.randint(jax.random.key(2), (batch, tokens), 2, cfg.vocab_size, jnp.int32)
    n_new = jnp.array([tokens, tokens - 7], jnp.int32)
    state = di.init_state(cfg, batch, tokens + 24)

    jax.clear_caches()
    masked_jaxpr = str(jax.make_jaxpr(_prefill)(params, state, ids, n_new))
    masked = _prefill(params, state, ids, n_new)
    monkeypatch.setattr(cached, "DENSE_ROWS_MAX", 0)
    monkeypatch.setattr(cached_v41, "DENSE_ROWS_MAX", 0)
    jax.clear_caches()
    gathered_jaxpr = str(jax.make_jaxpr(_prefill)(params, state, ids, n_new))
    gathered = _prefill(params, state, ids, n_new)
    jax.clear_caches()

    assert gathered_jaxpr != masked_jaxpr           # the other branch was traced
    a, b = np.asarray(masked[0]), np.asarray(gathered[0])
    rows = np.arange(tokens)[None, :] < np.asarray(n_new)[:, None]
    assert np.isfinite(a[rows]).all()
    rel = np.linalg.norm(a[rows] - b[rows]) / np.linalg.norm(a[rows])
    assert rel < 1e-5, rel
    for x, y in zip(jax.tree.leaves(masked[1]), jax.tree.leaves(gathered[1])):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64),
                                   rtol=1e-5, atol=1e-5)
