"""Block-level tests: each block against the transformers capture of the same block (so a
failure names the block), plus brute-force numpy oracles for rope, mHC, compressor, indexer
selection and the grouped MoE dispatch."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deepinfer_fn as di
from conftest import golden_params, rel_err
from deepinfer_fn.config import CSA, HCA, SWA
from deepinfer_fn.model import attention, compressor, indexer, mhc, moe, rope, transformer

TOL = 1e-5


def _positions(b, t):
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def _layers(name):
    cfg = golden_params(name).config
    return [(name, i) for i in range(cfg.num_hidden_layers)]


LAYERS = _layers("cfg_a") + _layers("cfg_c")


@functools.partial(jax.jit, static_argnums=(3,))
def _attention(p, x, positions, layer_type, cfg_params):
    return attention.attention_sequence(p, x, positions, layer_type, cfg_params.config)


@pytest.mark.parametrize("name,layer", LAYERS)
def test_attention_block(name, layer, golden):
    ref, params = golden(name), golden_params(name)
    cfg = params.config
    x = ref[f"layers.{layer}.attn_in"]
    pos = _positions(*x.shape[:2])
    out = attention.attention_sequence(params["layers"][layer]["attn"], jnp.asarray(x), pos,
                                       cfg.layer_types[layer], cfg)
    assert rel_err(out, ref[f"layers.{layer}.attn_out"]) < TOL


@pytest.mark.parametrize("name,layer", [l for l in LAYERS
                                        if golden_params(l[0]).config.layer_types[l[1]] != SWA])
def test_compressor_rows(name, layer, golden):
    ref, params = golden(name), golden_params(name)
    cfg = params.config
    lt = cfg.layer_types[layer]
    p = params["layers"][layer]["attn"]
    x = jnp.asarray(ref[f"layers.{layer}.attn_in"])
    freqs = rope.rope_frequencies(cfg, lt)
    ratio = cfg.compress_ratio_of(lt)
    rows = compressor.compress_sequence(p["compressor"], x, ratio, lt == CSA, freqs, cfg.rms_norm_eps)
    assert rel_err(rows, ref[f"layers.{layer}.compressor_out"]) < TOL
    if lt == CSA:
        irows = compressor.compress_sequence(p["indexer"]["compressor"], x, ratio, True, freqs,
                                             cfg.rms_norm_eps)
        assert rel_err(irows, ref[f"layers.{layer}.indexer_rows"]) < TOL


@pytest.mark.parametrize("name,layer", [l for l in LAYERS
                                        if golden_params(l[0]).config.layer_types[l[1]] == CSA])
def test_indexer_scores_and_top_k(name, layer, golden):
    ref, params = golden(name), golden_params(name)
    cfg = params.config
    p = params["layers"][layer]["attn"]
    x = jnp.asarray(ref[f"layers.{layer}.attn_in"])
    b, t, _ = x.shape
    pos = _positions(b, t)
    freqs = rope.rope_frequencies(cfg, CSA)
    cos, sin = rope.rope_cos_sin(pos, freqs)
    _, c_q, _ = attention.query_and_kv(p, x, cos, sin, cfg)
    irows = jnp.asarray(ref[f"layers.{layer}.indexer_rows"])
    q, w = indexer.index_queries(p["indexer"], c_q, x, cos, sin, cfg)
    scores = indexer.index_scores(q, w, irows)
    if f"layers.{layer}.indexer_scores" in ref:
        assert rel_err(scores, ref[f"layers.{layer}.indexer_scores"]) < TOL
    visible = attention.row_visibility(pos, irows.shape[1], cfg.csa_ratio)
    chosen = np.asarray(indexer.select_top_k(scores, visible, cfg.index_topk))
    want_idx = ref[f"layers.{layer}.indexer_topk"]
    want = np.zeros_like(chosen)
    for bi in range(b):
        for ti in range(t):
            sel = want_idx[bi, ti][want_idx[bi, ti] >= 0]
            want[bi, ti, sel] = True
    np.testing.assert_array_equal(chosen, want)


@pytest.mark.parametrize("layer", range(4))
def test_router_and_moe(layer, golden):
    ref, params = golden("cfg_a"), golden_params("cfg_a")
    cfg = params.config
    p = params["layers"][layer]["ffn"]
    x = jnp.asarray(ref[f"layers.{layer}.mlp_in"])
    ids = jnp.asarray(ref["input_ids"])
    idx, w = moe.route(p, x.reshape(-1, x.shape[-1]), ids.reshape(-1), cfg.mlp_layer_types[layer], cfg)
    order = np.argsort(np.asarray(idx), axis=-1, kind="stable")
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(idx), order, -1),
                                  ref[f"layers.{layer}.router_idx"])
    np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, -1),
                               ref[f"layers.{layer}.router_w"], rtol=1e-5, atol=1e-6)
    out = moe.moe_layer(p, x, ids, cfg.mlp_layer_types[layer], cfg)
    assert rel_err(out, ref[f"layers.{layer}.mlp_out"]) < TOL


def test_whole_layers_streams(golden):
    """Layer-by-layer residual streams (mHC collapse/expand included) from the reference's
    own layer inputs, so an error is attributed to one layer."""
    ref, params = golden("cfg_a"), golden_params("cfg_a")
    cfg = params.config
    ids = jnp.asarray(ref["input_ids"])
    pos = _positions(*ids.shape)
    emb = ref["embed_out"]
    np.testing.assert_array_equal(np.asarray(params["embed"][ids]), emb)
    streams = jnp.broadcast_to(jnp.asarray(emb)[:, :, None], (*emb.shape[:2], cfg.hc_mult, emb.shape[-1]))
    for i, (lt, mt) in enumerate(zip(cfg.layer_types, cfg.mlp_layer_types)):
        out = transformer.block(params["layers"][i], streams, ids, pos, lt, mt, cfg)
        want = ref[f"layers.{i}.streams_out"]
        assert rel_err(out, want) < TOL, f"layer {i}"
        streams = jnp.asarray(want)


def test_rope_frequencies_match_transformers(golden):
    for name in ("cfg_a", "cfg_b", "cfg_c"):
        ref, cfg = golden(name), golden_params(name).config
        np.testing.assert_allclose(rope.rope_frequencies(cfg, SWA), ref["rope.main_inv_freq"], rtol=1e-6)
        np.testing.assert_allclose(rope.rope_frequencies(cfg, CSA), ref["rope.compress_inv_freq"], rtol=1e-6)


# ----------------------------------------------------------------------- brute-force oracles
def test_rope_is_complex_rotation_of_trailing_pairs():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 12)).astype(np.float32)
    freqs = np.array([1.0, 0.3, 0.01])
    pos = np.array([[0, 1, 7, 100, 4096]] * 3)
    cos, sin = rope.rope_cos_sin(jnp.asarray(pos), freqs)
    got = np.asarray(rope.apply_rope(jnp.asarray(x), cos, sin))
    z = x[..., 6::2] + 1j * x[..., 7::2]
    angle = pos[..., None].astype(np.float32) * freqs.astype(np.float32)  # fp32, as the model
    zr = z * np.exp(1j * angle.astype(np.float64))
    want = x.copy()
    want[..., 6::2], want[..., 7::2] = zr.real, zr.imag
    np.testing.assert_allclose(got, want, atol=2e-5)
    back = rope.apply_rope(jnp.asarray(got), cos, sin, inverse=True)
    np.testing.assert_allclose(back, x, atol=2e-5)


def test_yarn_ramp_of_the_real_config():
    """§2.4: V4-Flash compress table keeps pairs 0-15, slows 25-31 by 16x, interpolates between."""
    cfg = di.ModelConfig.preset("v4-flash")
    f = rope.rope_frequencies(cfg, CSA)
    base = 160000.0 ** (-2 * np.arange(32) / 64)
    np.testing.assert_allclose(f[:16], base[:16], rtol=1e-12)
    np.testing.assert_allclose(f[25:], base[25:] / 16, rtol=1e-12)
    assert np.all((f[16:25] < base[16:25]) & (f[16:25] > base[16:25] / 16))
    np.testing.assert_allclose(rope.rope_frequencies(cfg, SWA), 1e4 ** (-2 * np.arange(32) / 64))


def _np_sinkhorn(m, iters, eps):
    p = np.exp(m - m.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True) + eps
    p = p / (p.sum(-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        p = p / (p.sum(-1, keepdims=True) + eps)
        p = p / (p.sum(-2, keepdims=True) + eps)
    return p


def test_mhc_against_numpy():
    rng = np.random.default_rng(1)
    n, d = 4, 8
    x = rng.standard_normal((2, 3, n, d)).astype(np.float32)
    fn = rng.standard_normal((n * d, (2 + n) * n)).astype(np.float32) * 0.3
    base = rng.standard_normal((2 + n) * n).astype(np.float32)
    scale = np.array([0.9, 1.1, 1.3], np.float32)
    pre, post, comb = mhc.mhc_weights(jnp.asarray(x), fn, base, scale, n=n, iters=20,
                                      hc_eps=1e-6, norm_eps=1e-6)
    flat = x.reshape(2, 3, -1)
    z = flat / np.sqrt((flat ** 2).mean(-1, keepdims=True) + 1e-6)
    u = z @ fn
    sig = lambda v: 1 / (1 + np.exp(-v))
    np.testing.assert_allclose(pre, sig(0.9 * u[..., :n] + base[:n]) + 1e-6, rtol=1e-5)
    np.testing.assert_allclose(post, 2 * sig(1.1 * u[..., n:2 * n] + base[n:2 * n]), rtol=1e-5)
    want = _np_sinkhorn((1.3 * u[..., 2 * n:] + base[2 * n:]).reshape(2, 3, n, n), 20, 1e-6)
    np.testing.assert_allclose(comb, want, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(comb).sum(-2), 1.0, atol=1e-4)  # ends on columns
    y = rng.standard_normal((2, 3, d)).astype(np.float32)
    new = mhc.expand(jnp.asarray(x), jnp.asarray(y), post, comb)
    want = np.asarray(post)[..., None] * y[:, :, None] + np.einsum("btjk,btjd->btkd", np.asarray(comb), x)
    np.testing.assert_allclose(new, want, rtol=1e-5, atol=1e-6)


def test_sinkhorn_output_is_a_fusion_barrier():
    """P leaves the Sinkhorn through an optimization barrier: without it XLA:GPU's priority
    fusion fuses the unrolled chain into the expand and the compile takes minutes."""
    logits = jnp.zeros((3, 4, 4), jnp.float32)
    text = jax.jit(lambda m: mhc.sinkhorn(m, 20, 1e-6)).lower(logits).as_text()
    assert "optimization_barrier" in text
    np.testing.assert_allclose(mhc.sinkhorn(logits, 20, 1e-6), np.full((3, 4, 4), 0.25),
                               rtol=1e-5)


@pytest.mark.parametrize("overlap", [False, True])
def test_compressor_pooling_against_loops(overlap):
    rng = np.random.default_rng(2)
    b, t, dim, m = 2, 19, 6, 4
    c = 2 if overlap else 1
    D = 10
    p = {"wkv": rng.standard_normal((D, c * dim)).astype(np.float32),
         "wgate": rng.standard_normal((D, c * dim)).astype(np.float32),
         "ape": rng.standard_normal((m, c * dim)).astype(np.float32),
         "norm": (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32)}
    x = rng.standard_normal((b, t, D)).astype(np.float32)
    freqs = np.array([0.5, 0.05])
    rows = np.asarray(compressor.compress_sequence(p, jnp.asarray(x), m, overlap, freqs, 1e-6))
    kv, g = x @ p["wkv"], x @ p["wgate"] + p["ape"][np.arange(t) % m]
    assert rows.shape == (b, t // m, dim)
    for bi in range(b):
        for w in range(t // m):
            toks = range(m * w, m * w + m)
            cands = [(kv[bi, s, dim:], g[bi, s, dim:]) if overlap else (kv[bi, s], g[bi, s]) for s in toks]
            if overlap and w > 0:
                cands += [(kv[bi, s, :dim], g[bi, s, :dim]) for s in range(m * w - m, m * w)]
            ks, gs = np.stack([k for k, _ in cands]), np.stack([gg for _, gg in cands])
            wts = np.exp(gs - gs.max(0)) / np.exp(gs - gs.max(0)).sum(0)
            pooled = (wts * ks).sum(0)
            normed = p["norm"] * pooled / np.sqrt((pooled ** 2).mean() + 1e-6)
            ang = m * w * freqs
            zz = (normed[-4::2] + 1j * normed[-3::2]) * np.exp(1j * ang)
            want = normed.copy()
            want[-4::2], want[-3::2] = zz.real, zz.imag
            np.testing.assert_allclose(rows[bi, w], want, rtol=2e-4, atol=2e-5)


def test_top_k_selection_against_argsort():
    rng = np.random.default_rng(3)
    scores = rng.standard_normal((2, 9, 7)).astype(np.float32)
    pos = np.broadcast_to(np.arange(9), (2, 9))
    visible = np.asarray(attention.row_visibility(jnp.asarray(pos), 7, 1))
    got = np.asarray(indexer.select_top_k(jnp.asarray(scores), jnp.asarray(visible), 3))
    for bi in range(2):
        for t in range(9):
            vis = np.flatnonzero(visible[bi, t])
            best = vis[np.argsort(-scores[bi, t, vis])[:3]]
            assert set(np.flatnonzero(got[bi, t])) == set(best.tolist())


def test_grouped_dispatch_equals_dense_experts():
    """Sorted grouped-GEMM dispatch == every token through each of its experts, one by one."""
    rng = np.random.default_rng(4)
    n, d, inter, e, k = 37, 16, 8, 5, 3
    p = {"w1": rng.standard_normal((e, d, inter)).astype(np.float32),
         "w3": rng.standard_normal((e, d, inter)).astype(np.float32),
         "w2": rng.standard_normal((e, inter, d)).astype(np.float32)}
    x = rng.standard_normal((n, d)).astype(np.float32)
    idx = np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32)
    idx[0] = [2, 2, 2]  # a repeated expert counts each time (§2.9)
    w = rng.random((n, k)).astype(np.float32)
    got = np.asarray(moe.routed_experts(p, jnp.asarray(x), jnp.asarray(idx), jnp.asarray(w), 10.0))
    want = np.zeros((n, d), np.float32)
    for i in range(n):
        for j in range(k):
            ee = idx[i, j]
            g = np.minimum(x[i] @ p["w1"][ee], 10.0)
            u = np.clip(x[i] @ p["w3"][ee], -10, 10)
            want[i] += w[i, j] * ((g / (1 + np.exp(-g)) * u) @ p["w2"][ee])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", [6, 384, 1500])   # one-hot reductions up to ONE_HOT_MAX, then scatters
def test_expert_counts_and_inverse_permutation(n):
    from deepinfer_fn.model import experts
    rng = np.random.default_rng(n)
    flat = rng.integers(0, 64, n).astype(np.int32)
    got = np.asarray(jax.jit(experts.counts, static_argnums=1)(jnp.asarray(flat), 64))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.bincount(flat, minlength=64))
    order = rng.permutation(n).astype(np.int32)
    inv = np.asarray(jax.jit(experts.inverse_permutation)(jnp.asarray(order)))
    np.testing.assert_array_equal(inv[order], np.arange(n))
    flat_order = np.argsort(flat, kind="stable").astype(np.int32)
    pos = np.asarray(jax.jit(experts.sorted_positions)(jnp.asarray(flat), jnp.asarray(flat_order)))
    np.testing.assert_array_equal(pos[flat_order], np.arange(n))
    rows = rng.standard_normal((n, 3)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(experts.unsort(jnp.asarray(rows), jnp.asarray(order))),
                                  rows[np.argsort(order)])


def test_sorted_positions_are_computed_once():
    """The one-hot ranks leave their computation through an optimization barrier: without it
    XLA:GPU fused the n x n comparison reduction into the consumers of the unsorted MoE rows
    (the mHC expand) and recomputed it for every element they wrote."""
    from deepinfer_fn.model import experts
    flat = jnp.arange(12, dtype=jnp.int32) % 5
    jaxpr = jax.make_jaxpr(experts.sorted_positions)(flat, jnp.argsort(flat, stable=True))
    assert any(e.primitive.name == "optimization_barrier" for e in jaxpr.jaxpr.eqns)


@pytest.mark.parametrize("slices_max", [0, 64])
def test_mhc_collapse_and_expand_roundings_bf16(monkeypatch, slices_max):
    """bf16 streams: collapse and expand round where the spec's matmul-in-the-stream-dtype
    does (§2.3 step 7), summing over j in stream order; against numpy with ml_dtypes. Both
    forms of expand (per-token gate slices, whole-array broadcast)."""
    from deepinfer_fn.model import mhc_math
    monkeypatch.setattr(mhc_math, "EXPAND_SLICES_MAX_TOKENS", slices_max)
    bf16 = jnp.bfloat16
    r = lambda a: np.asarray(a, np.float32).astype(bf16).astype(np.float32)
    rng = np.random.default_rng(7)
    n, d = 4, 16
    x = r(rng.standard_normal((3, n, d)))
    y = r(rng.standard_normal((3, d)))
    pre = rng.uniform(0.1, 1.0, (3, n)).astype(np.float32)
    post = rng.uniform(0.1, 2.0, (3, n)).astype(np.float32)
    comb = rng.uniform(0.0, 1.0, (3, n, n)).astype(np.float32)
    h = np.zeros((3, d), np.float32)
    for j in range(n):
        h = h + pre[:, j, None] * x[:, j]
    got = mhc.collapse(jnp.asarray(x, bf16), jnp.asarray(pre))
    np.testing.assert_array_equal(np.asarray(got, np.float32), r(h))
    want = np.zeros((3, n, d), np.float32)
    for k in range(n):
        mixed = np.zeros((3, d), np.float32)
        for j in range(n):
            mixed = mixed + r(comb[:, j, k])[:, None] * x[:, j]
        want[:, k] = r(r(r(post[:, k])[:, None] * y) + r(mixed))
    got = mhc.expand(jnp.asarray(x, bf16), jnp.asarray(y, bf16), jnp.asarray(post),
                     jnp.asarray(comb))
    assert got.dtype == bf16
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)
