"""DeepSeek-V4.1 forward pass (docs/MODEL.md §V2, validation plan §7): the whole tiny forward
against a float64 numpy re-derivation of the spec with explicit per-token loops; the mHC lag
(degenerate equivalence with V4's fused form, and the fused form differing otherwise); sharing
(non-source layers read their source's buffers, garbage elsewhere changes nothing); the
candidate prefilter and full top-k against brute force; code-2 pair pooling and row visibility
against numpy loops; FP8 and dequantised Engram tables agree."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import deepinfer_fn as di
from deepinfer_fn import api
from deepinfer_fn.model import attention_v41, engram, latents, selection, transformer_v41
from deepinfer_fn.model.rope import rope_cos_sin, rope_frequencies
from deepinfer_fn.params import init_params
from deepinfer_fn.state import init_v41_state

# 16 indexer heads: exact-zero index scores (all relu terms zero) become rare, so no ties.
# 4 Sinkhorn iterations (the reference uses the config's count too): the unrolled iterations
# dominate compile time, and their number is not a V4.1 matter (tests/test_blocks.py).
CFG = di.ModelConfig.preset("v4.1-tiny", index_n_heads=16, hc_sinkhorn_iters=4)
T = 16                                   # > window 8; code-1 rows 16 > kept candidates 2 x 2


def tokens(seed=0, batch=1, length=T, image_at=()):
    """Random ids, the image token only at positions `image_at` (Engram skips and blocks it,
    the router selects with bias_vl there)."""
    ids = np.random.default_rng(seed).integers(3, CFG.image_token_id, (batch, length))
    ids[:, list(image_at)] = CFG.image_token_id
    return ids


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(0))


# --------------------------------------------------------------------- numpy reference (f64)
def f64(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64) if np.issubdtype(
        np.asarray(a).dtype, np.floating) else np.asarray(a), tree)


def rms_w(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x) + eps)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def rope(x, pos, freqs, inverse=False):
    """Interleaved rotation of the trailing 2 * len(freqs) channels of a vector."""
    r = 2 * len(freqs)
    out = x.copy()
    ang = pos * freqs * (-1.0 if inverse else 1.0)
    lo = len(x) - r
    a, b = x[lo::2], x[lo + 1::2]
    out[lo::2] = a * np.cos(ang) - b * np.sin(ang)
    out[lo + 1::2] = a * np.sin(ang) + b * np.cos(ang)
    return out


def ref_mhc(hc, X, cfg):
    """(pre, post, comb) of one module for one token's streams X [n, D]."""
    n = cfg.hc_mult
    flat = X.reshape(-1)
    u = (flat / np.sqrt(np.mean(flat * flat) + cfg.rms_norm_eps)) @ hc["fn"]
    s, b, eps = hc["scale"], hc["base"], cfg.hc_eps
    pre = sigmoid(s[0] * u[:n] + b[:n]) + eps
    post = 2 * sigmoid(s[1] * u[n:2 * n] + b[n:2 * n])
    m = (s[2] * u[2 * n:] + b[2 * n:]).reshape(n, n)
    P = np.exp(m - m.max(1, keepdims=True))
    P = P / P.sum(1, keepdims=True) + eps
    P = P / (P.sum(0, keepdims=True) + eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        P = P / (P.sum(1, keepdims=True) + eps)
        P = P / (P.sum(0, keepdims=True) + eps)
    return pre, post, P


def ref_sublayer(hc, norm, X, p, F, cfg, lagged=True):
    """X [T, n, D]; p [T, n] or None -> (X', pre [T, n])."""
    stats = [ref_mhc(hc, X[t], cfg) for t in range(len(X))]
    pre = np.stack([s[0] for s in stats])
    use = pre if not lagged else p
    xin = np.stack([X[t, 0] if use is None else sum(use[t, j] * X[t, j] for j in range(cfg.hc_mult))
                    for t in range(len(X))])
    x = np.stack([rms_w(v, norm, cfg.rms_norm_eps) for v in xin])
    y = F(x)
    out = np.empty_like(X)
    for t, (_, post, P) in enumerate(stats):
        for k in range(cfg.hc_mult):
            out[t, k] = post[k] * y[t] + sum(P[j, k] * X[t, j] for j in range(cfg.hc_mult))
    return out, pre


def ref_moe(fp, x, ids, cfg):
    out = np.zeros_like(x)
    lim = cfg.swiglu_limit
    silu = lambda g: g * sigmoid(g)
    expert = lambda w1, w3, w2, v: (silu(np.minimum(v @ w1, lim)) * np.clip(v @ w3, -lim, lim)) @ w2
    for t, v in enumerate(x):
        s = np.sqrt(np.log1p(np.exp(v @ fp["gate"])))
        bias = fp["gate_bias_vl"] if ids[t] == cfg.image_token_id else fp["gate_bias"]
        idx = np.argsort(-(s + bias), kind="stable")[:cfg.num_experts_per_tok]
        w = s[idx] / s[idx].sum() * cfg.routed_scaling_factor
        out[t] = sum(wi * expert(fp["w1"][e], fp["w3"][e], fp["w2"][e], v) for wi, e in zip(w, idx))
        sh = fp["shared"]
        out[t] += expert(sh["w1"], sh["w3"], sh["w2"], v)
    return out


def ref_top(score_of, candidates, k):
    """The k best of `candidates` (row ids, increasing) by score, ties to the lower id."""
    return sorted(sorted(candidates, key=lambda j: -score_of[j])[:k])


def ref_attention(ap, x, layer, shared, cfg):
    """One layer's attention over x [T, D] with explicit loops; updates `shared`."""
    Tn, eps = len(x), cfg.rms_norm_eps
    H, d, W = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
    code = cfg.compress_ratio(layer)
    freqs = rope_frequencies(cfg, cfg.layer_types[layer])
    c_q = [rms_w(v @ ap["wq_a"], ap["q_norm"], eps) for v in x]
    q = [np.stack([rope(h, t, freqs) for h in (c_q[t] @ ap["wq_b"]).reshape(H, d)])
         for t in range(Tn)]
    kv = [rope(rms_w(x[s] @ ap["wkv"], ap["kv_norm"], eps), s, freqs) for s in range(Tn)]
    if code and layer in cfg.kv_source_layer_ids:
        cp, ip = ap["compressor"], ap["indexer"]
        lat = []
        if code == 1:
            lat = [rms_w(v @ cp["wkv"], cp["norm"], eps) for v in x]
        else:
            for j in range(Tn // 2):
                ks = [x[s] @ cp["wkv"] for s in (2 * j, 2 * j + 1)]
                gs = [x[s] @ cp["wgate"] for s in (2 * j, 2 * j + 1)]
                e0, e1 = np.exp(gs[0] - np.maximum(*gs)), np.exp(gs[1] - np.maximum(*gs))
                lat.append(rms_w((e0 * ks[0] + e1 * ks[1]) / (e0 + e1), cp["norm"], eps))
        shared[code] = dict(
            rows=[rope(L, code * j, freqs) for j, L in enumerate(lat)],
            keys=[rope(rms_w(L @ ip["wk"], ip["k_norm"], eps), code * j, freqs)
                  for j, L in enumerate(lat)])
    if code and layer in cfg.index_source_layer_ids:
        ip, HI, dI = ap["indexer"], cfg.index_n_heads, cfg.index_head_dim
        keys, sel, blocks = shared[code]["keys"], [], []
        B, keep = cfg.candidate_block_size, cfg.candidate_topk_blocks
        for t in range(Tn):
            qi = [rope(h, t, freqs) for h in (c_q[t] @ ip["wq_b"]).reshape(HI, dI)]
            om = (x[t] @ ip["weights_proj"]) / math.sqrt(HI * dI)
            n_vis = (t + 1) // code
            sc = {j: sum(om[h] * max(qi[h] @ keys[j], 0.0) for h in range(HI)) for j in range(n_vis)}
            cand = list(range(n_vis))
            if cfg.candidate_role(layer) == "consume":
                cand = [j for j in cand if j // B in shared["blocks"][t]]
            sel.append(ref_top(sc, cand, cfg.index_topk))
            if cfg.candidate_role(layer) == "publish":
                nb = -(-n_vis // B)
                bs = {b: max(sc[j] for j in range(b * B, min(n_vis, (b + 1) * B))) for b in range(nb)}
                if nb:
                    bs[nb - 1] = np.inf
                blocks.append(set(ref_top(bs, range(nb), keep)))
        shared["sel", code] = sel
        if blocks:
            shared["blocks"] = blocks
    out = []
    G = cfg.o_groups
    for t in range(Tn):
        ks = [kv[s] for s in range(max(0, t - W + 1), t + 1)]
        if code:
            ks += [shared[code]["rows"][j] for j in shared["sel", code][t]]
        K = np.stack(ks)
        o = np.empty((H, d))
        for h in range(H):
            logits = np.append(K @ q[t][h] / math.sqrt(d), ap["sinks"][h])
            pr = np.exp(logits - logits.max())
            pr = pr / pr.sum()
            o[h] = rope(pr[:-1] @ K, t, freqs, inverse=True)
        z = np.concatenate([o.reshape(G, -1)[g] @ ap["wo_a"][g] for g in range(G)])
        out.append(z @ ap["wo_b"])
    return np.stack(out)


def ref_engram(ep, X, rows, ids, cfg):
    """X [T, n, D]; rows [T, C] table row ids; table float64 [R, W] (dequantised); image
    token rows unchanged."""
    n, D, eps = cfg.hc_mult, cfg.hidden_size, cfg.rms_norm_eps
    r = lambda v: v / np.sqrt(np.mean(v * v) + eps)
    out = X.copy()
    for t in range(len(X)):
        if ids[t] == cfg.image_token_id:
            continue
        kv = np.concatenate([ep["table"][i] for i in rows[t]]) @ ep["wkv"]
        v = kv[n * D:]
        for j in range(n):
            s = np.sum(r(X[t, j]) * ep["q_weight"][j] * ep["k_weight"][j] * r(kv[j * D:(j + 1) * D]))
            s /= math.sqrt(D)
            g = sigmoid(np.sign(s) * math.sqrt(max(abs(s), 1e-6)))
            out[t, j] = X[t, j] + g * v
    return out


def dequantized_table(codes, scales):
    """FP8 E4M3 bytes x 2^(UE8M0 - 127) per 32 values, in float64 (ml_dtypes decode)."""
    v = np.asarray(codes).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    f = np.exp2(np.asarray(scales, np.float64) - 127.0)
    return v * np.repeat(f, 32, axis=-1)[:, :v.shape[-1]]


def ref_forward(params, ids, cfg, lagged=True):
    """float64 logits [T, V] of one sequence (a numpy loop over the spec, §V2.0-§V2.9)."""
    consts = engram.HashConstants.from_config(cfg)
    rows = engram.hash_ids_host(ids[None], np.full((1, consts.history), consts.pad_id),
                                np.arange(cfg.vocab_size), consts)[0]
    w = f64({k: params[k] for k in ("embed", "norm", "head")})
    X = np.repeat(w["embed"][ids][:, None], cfg.hc_mult, axis=1)
    p, shared = None, {}
    for l in range(cfg.num_hidden_layers):
        lp = f64(params["layers"][l])
        if l in cfg.engram_layer_ids:
            ep = dict(lp["engram"], table=dequantized_table(params["layers"][l]["engram"]["table"],
                                                            params["layers"][l]["engram"]["table_scale"]))
            X = ref_engram(ep, X, rows[:, cfg.engram_layer_ids.index(l)], ids, cfg)
        X, p = ref_sublayer(lp["hc_attn"], lp["attn_norm"], X, p,
                            lambda x: ref_attention(lp["attn"], x, l, shared, cfg), cfg, lagged)
        X, p = ref_sublayer(lp["hc_ffn"], lp["ffn_norm"], X, p,
                            lambda x: ref_moe(lp["ffn"], x, ids, cfg), cfg, lagged)
    h = np.stack([rms_w(sum(p[t, j] * X[t, j] for j in range(cfg.hc_mult)), w["norm"],
                        cfg.rms_norm_eps) for t in range(len(X))])
    return h @ w["head"]


# --------------------------------------------------------------------------------- tests
def test_whole_forward_matches_numpy_loop_reference(params):
    ids = tokens(0, image_at=(6,))
    got = np.asarray(api.forward(params, ids))[0]
    want = ref_forward(params, ids[0], CFG)
    assert got.shape == (T, CFG.vocab_size) and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


@pytest.fixture(scope="module")
def fused_forward():
    return jax.jit(lambda p, i: transformer_v41.logits_and_streams(p, i, lagged=False)[0])


def constant_pre(params):
    """fn = 0 in every mHC module and the same pre-part of base everywhere: pre is constant."""
    rng = np.random.default_rng(5)
    b_pre = rng.normal(0.0, 0.5, CFG.hc_mult).astype(np.float32)

    def fix(hc):
        return {**hc, "fn": jnp.zeros_like(hc["fn"]),
                "base": hc["base"].at[..., :CFG.hc_mult].set(b_pre)}
    layers = tuple({**lp, "hc_attn": fix(lp["hc_attn"]), "hc_ffn": fix(lp["hc_ffn"])}
                   for lp in params["layers"])
    return di.Params({**params.weights, "layers": layers}, CFG)


def test_mhc_lag_degenerate_equals_fused_form(params, fused_forward):
    p = constant_pre(params)
    ids = tokens(1)
    lagged = np.asarray(api.forward(p, ids))
    fused = np.asarray(fused_forward(p, jnp.asarray(ids, jnp.int32)))
    np.testing.assert_allclose(lagged, fused, rtol=1e-4, atol=1e-4 * np.abs(fused).max())


def test_mhc_lag_differs_from_fused_form_with_random_fn(params, fused_forward):
    ids = tokens(1)
    lagged = np.asarray(api.forward(params, ids))
    fused = np.asarray(fused_forward(params, jnp.asarray(ids, jnp.int32)))
    assert np.abs(lagged - fused).max() > 0.05 * np.abs(fused).max()
    # and the numpy reference in V4's form agrees with the fused variant (both are the same form)
    np.testing.assert_allclose(fused[0], ref_forward(params, ids[0], CFG, lagged=False),
                               rtol=2e-4, atol=2e-4 * np.abs(fused).max())


# ---------------------------------------------------------------------- sharing, one layer
def attn_jit(kind):
    return jax.jit(lambda ap, x, shared: attention_v41.attention_sequence(
        ap, x, jnp.arange(x.shape[1])[None], kind, shared, CFG))


def layer_inputs(seed=3):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(0, 1, (1, T, CFG.hidden_size)), jnp.float32)


def random_shared(seed):
    """Shared buffers filled with random rows / keys and random selections."""
    base = attention_v41.empty_shared(CFG, 1, T, jnp.float32)
    leaves, tree = jax.tree.flatten(base)
    rng = np.random.default_rng(seed)
    filled = [jnp.asarray(rng.random(x.shape) < 0.5) if x.dtype == bool
              else jnp.asarray(rng.normal(0, 1, x.shape), x.dtype) for x in leaves]
    return jax.tree.unflatten(tree, filled)


def test_reader_layer_reads_its_code_buffers_only(params):
    """Layer 3 (code 2, not a source) attends to the code-2 rows and selection: garbage in
    the code-1 buffers, the candidates, or extra compressor / indexer weights in the layer's
    own params changes nothing; new code-2 rows change the output."""
    kind = CFG.layer_kind(3)[0]
    assert kind == "pair_sparse_attention", kind
    ap = params["layers"][3]["attn"]
    fn = attn_jit(kind)
    x = layer_inputs()
    shared = random_shared(0)
    out, new = fn(ap, x, shared)
    jax.tree.map(np.testing.assert_array_equal, new, shared)       # a reader writes nothing
    other = random_shared(1)
    mixed = {**shared, "latents": {**shared["latents"], 1: other["latents"][1]},
             "selected": {**shared["selected"], 1: other["selected"][1]},
             "candidates": other["candidates"]}
    garbage_ap = {**ap, "compressor": params["layers"][2]["attn"]["compressor"],
                  "indexer": jax.tree.map(lambda a: a * 7.0, params["layers"][2]["attn"]["indexer"])}
    np.testing.assert_array_equal(np.asarray(attn_jit(kind)(garbage_ap, x, mixed)[0]), out)
    changed = {**shared, "latents": {**shared["latents"], 2: other["latents"][2]}}
    assert np.abs(np.asarray(fn(ap, x, changed)[0]) - np.asarray(out)).max() > 1e-3


def test_consumer_scores_source_keys_within_published_blocks(params):
    """Layer 6 (code 1 consumer): reads layer 4's index keys and published blocks, writes only
    the code-1 selection, which equals brute-force top-k inside the blocks."""
    kind = CFG.layer_kind(6)[0]
    assert "candidate_consume" in kind and "kv_source" not in kind, kind
    ap = params["layers"][6]["attn"]
    x = layer_inputs(4)
    shared = random_shared(2)
    _, new = attn_jit(kind)(ap, x, shared)
    for c in (2,):
        np.testing.assert_array_equal(new["selected"][c], shared["selected"][c])
    np.testing.assert_array_equal(new["candidates"], shared["candidates"])
    jax.tree.map(np.testing.assert_array_equal, new["latents"], shared["latents"])
    # brute force: the consumer's own scores against the buffer's keys
    s = np.asarray(_scores(ap, x, shared["latents"][1]["keys"]))[0]
    blocks = np.asarray(shared["candidates"])[0]
    for t in range(T):
        cand = [j for j in range((t + 1)) if blocks[t, j // CFG.candidate_block_size]]
        want = ref_top(s[t], cand, CFG.index_topk)
        assert np.flatnonzero(np.asarray(new["selected"][1])[0, t]).tolist() == want, t


def _scores(ap, x, keys):
    pos = jnp.arange(x.shape[1])[None]
    cos, sin = rope_cos_sin(pos, latents.compress_freqs(CFG), x.dtype)
    _, c_q = attention_v41.query(ap, x, cos, sin, CFG)
    return selection.scores(ap["indexer"], c_q, x, keys, cos, sin, CFG)


# ------------------------------------------------------------------- selection vs brute force
def random_scores(seed, shape):
    return np.random.default_rng(seed).normal(0, 1, shape).astype(np.float32)


def brute_blocks(s, n_vis, block, keep):
    nb = -(-n_vis // block)
    bs = {b: max(s[j] for j in range(b * block, min(n_vis, (b + 1) * block))) for b in range(nb)}
    if nb:
        bs[nb - 1] = np.inf
    return set(ref_top(bs, range(nb), keep))


@pytest.mark.parametrize("code", [1, 2])
def test_candidate_prefilter_vs_brute_force(code):
    n_rows, k, block = T // code, 3, 2
    s = random_scores(code, (1, T, n_rows))
    vis = latents.visible_rows(jnp.arange(T)[None], n_rows, code)
    full = np.asarray(selection.full_top_k(jnp.asarray(s), vis, k))[0]
    for keep, bites in ((-(-n_rows // block), False), (2, True)):
        blocks = selection.candidate_blocks(jnp.asarray(s), vis, block, keep)
        chosen = np.asarray(selection.candidate_top_k(jnp.asarray(s), vis, blocks, block, k))[0]
        differs = False
        for t in range(T):
            n_vis = (t + 1) // code
            want_blocks = brute_blocks(s[0, t], n_vis, block, keep)
            assert set(np.flatnonzero(np.asarray(blocks)[0, t]).tolist()) == want_blocks, t
            if n_vis:
                assert (n_vis - 1) // block in want_blocks        # the newest block is kept
            cand = [j for j in range(n_vis) if j // block in want_blocks]
            want = ref_top(s[0, t], cand, k)
            assert np.flatnonzero(chosen[t]).tolist() == want, (keep, t)
            assert np.flatnonzero(full[t]).tolist() == ref_top(s[0, t], range(n_vis), k)
            differs |= want != ref_top(s[0, t], range(n_vis), k)
        if bites:
            assert differs, "a small candidate set should change some selection"
        else:
            np.testing.assert_array_equal(chosen, full)     # covering every row: a no-op


@pytest.mark.parametrize("n_rows,k", [(37, 8), (5, 8), (16, 16)])
def test_selected_rows_are_the_masks_indices(n_rows, k):
    """The cached attention's row_idx: the mask's True rows in order, then -1."""
    rng = np.random.default_rng(n_rows)
    mask = np.zeros((2, 3, n_rows), bool)
    for row in mask.reshape(-1, n_rows):
        row[rng.choice(n_rows, rng.integers(0, min(k, n_rows) + 1), replace=False)] = True
    assert mask.sum() > 0                                  # the rows above wrote into it
    got = np.asarray(selection.selected_rows(jnp.asarray(mask), k))
    assert got.shape == (2, 3, min(k, n_rows))
    for g, m in zip(got.reshape(-1, got.shape[-1]), mask.reshape(-1, n_rows)):
        want = np.flatnonzero(m).tolist()
        assert g.tolist() == want + [-1] * (len(g) - len(want))


# -------------------------------------------------------------------------- latents vs loops
def test_pair_pooling_and_visibility_vs_numpy_loop(params):
    cp = f64(params["layers"][2]["attn"]["compressor"])
    x = np.asarray(layer_inputs(7))[:, :T - 1]                     # odd: the last token waits
    got = np.asarray(latents.source_latents(params["layers"][2]["attn"]["compressor"],
                                            jnp.asarray(x), 2, CFG.rms_norm_eps))[0]
    assert got.shape == ((T - 1) // 2, CFG.head_dim)
    for j in range((T - 1) // 2):
        pooled = np.zeros(CFG.head_dim)
        for c in range(CFG.head_dim):
            g = [x[0, s] @ cp["wgate"][:, c] for s in (2 * j, 2 * j + 1)]
            kap = [x[0, s] @ cp["wkv"][:, c] for s in (2 * j, 2 * j + 1)]
            e = [math.exp(v - max(g)) for v in g]
            pooled[c] = (e[0] * kap[0] + e[1] * kap[1]) / (e[0] + e[1])
        np.testing.assert_allclose(got[j], rms_w(pooled, cp["norm"], CFG.rms_norm_eps),
                                   rtol=1e-5, atol=1e-5)
    for code in (1, 2):
        vis = np.asarray(latents.visible_rows(jnp.arange(T)[None], T // code, code))[0]
        for t in range(T):
            for j in range(T // code):
                # row j closes at token code*j + code-1 and is visible from then on
                assert vis[t, j] == (code * j + code - 1 <= t), (code, t, j)


def test_float_tables_equal_fp8_tables(params):
    ew = params["layers"][1]["engram"]
    f = dict(ew, table=jnp.asarray(dequantized_table(ew["table"], ew["table_scale"]), jnp.float32))
    rng = np.random.default_rng(9)
    streams = jnp.asarray(rng.normal(0, 1, (1, 5, CFG.hc_mult, CFG.hidden_size)), jnp.float32)
    ids = jnp.asarray(tokens(9, 1, 5), jnp.int32)
    rows = transformer_v41.engram_row_ids(CFG, ids)[:, :, 0]
    a = transformer_v41.engram_update(ew, streams, rows, ids, CFG)
    b = transformer_v41.engram_update(f, streams, rows, ids, CFG)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(a) - np.asarray(streams)).max() > 1e-3


# ------------------------------------------------------------------- decode state, chunks
def run_chunks(params, ids, plan, S, window_slots=None, seed=0):
    """Feed ids [B, T] through `forward_chunk` in chunks padded to S. plan: steps, each a
    (n_feed, n_keep) per row: the row's next n_keep ids, then n_feed - n_keep garbage ids
    (rejected drafts), after which `lengths` moves back to the kept tokens. Returns the
    logits of every kept token [B, T, V] and the final state."""
    step = jax.jit(lambda p, s, i, n: transformer_v41.forward_chunk(p, s, i, n, all_logits=True)[:2])
    rng = np.random.default_rng(seed)
    B = ids.shape[0]
    state = init_v41_state(CFG, B, 2 * T, window_slots=window_slots)
    pos, out = np.zeros(B, int), [[] for _ in range(B)]
    for row_steps in plan:
        chunk = rng.integers(3, CFG.image_token_id, (B, S)).astype(np.int32)
        feed, keep = (np.array(v) for v in zip(*row_steps))
        for b in range(B):
            chunk[b, :keep[b]] = ids[b, pos[b]:pos[b] + keep[b]]
        logits, state = step(params, state, jnp.asarray(chunk), jnp.asarray(feed, jnp.int32))
        for b in range(B):
            out[b].append(np.asarray(logits)[b, :keep[b]])
        pos += keep
        state = dataclasses.replace(state, lengths=jnp.asarray(pos, jnp.int32))
    assert (pos == ids.shape[1]).all()
    return np.stack([np.concatenate(o) for o in out]), state


@pytest.mark.heavy
def test_chunked_prefill_and_decode_equal_whole_forward(params):
    """Ragged chunks (odd starts: a code-2 pair split across chunks; an idle row), verify
    chunks whose rejected tail is rolled back by `lengths` alone (at an even and an odd
    start), and token-by-token decode give the whole forward's logits."""
    ids = tokens(11, batch=2, image_at=(7,))
    whole = np.asarray(api.forward(params, ids))
    tol = dict(rtol=1e-4, atol=1e-4 * np.abs(whole).max())
    S = 5
    plan = [[(5, 5), (3, 3)], [(5, 5), (0, 0)], [(5, 1), (5, 2)], [(5, 5), (5, 5)],
            [(0, 0), (5, 5)], [(0, 0), (1, 1)]]
    chunked, state = run_chunks(params, ids, plan, S, window_slots=CFG.sliding_window + S - 2)
    np.testing.assert_allclose(chunked, whole, **tol)
    consts = engram.HashConstants.from_config(CFG)
    np.testing.assert_array_equal(np.asarray(transformer_v41.chunk_history(state, consts)),
                                  ids[:, -3:])
    stepped, state = run_chunks(params, ids[:1], [[(1, 1)]] * T, 1)
    np.testing.assert_allclose(stepped, whole[:1], **tol)
    # only the kv sources hold compressed rows
    for i, ls in enumerate(state.layers):
        assert ("rows" in ls) == (i in CFG.kv_source_layer_ids), (i, sorted(ls))


@pytest.mark.heavy
def test_greedy_generate_equals_forward_argmax_rollout(params):
    """`generate` runs V4.1 through the `init_state` / `forward_chunk` dispatch: each greedy
    token is the no-cache forward's argmax over the prompt and the tokens before it."""
    ids = tokens(12, length=T - 5)
    out = np.asarray(di.generate(params, ids, max_new_tokens=5, prefill_chunk=4,
                                 decoder_swa_bounded_replay=False).tokens)
    seq = np.concatenate([ids, out], axis=1)
    assert seq.shape == (1, T)
    argmax = np.asarray(api.forward(params, seq)).argmax(-1)
    np.testing.assert_array_equal(out, argmax[:, T - 6:T - 1])


def test_state_bytes_follow_the_spec_memory_table():
    """docs/MODEL.md §V3.2: 3,200 bytes per token in bf16 (three code-2 sources at half a
    row per token, one code-1 source), window rings 40 x 128 x 512 x 2 bytes."""
    from deepinfer_fn.state import state_bytes
    flash = di.ModelConfig.preset("v4.1-flash")
    per_1024 = state_bytes(flash, 1, 2048) - state_bytes(flash, 1, 1024)
    assert per_1024 == 3200 * 1024
    rings = 40 * 128 * (512 * 2 + 4)                 # rotated KV (bf16) + slot positions
    pending = 3 * 2 * 512 * (2 + 4)                  # code-2 raw kappa (bf16) + gate (f32)
    fixed = state_bytes(flash, 1, 1024) - 3200 * 1024
    assert fixed == rings + pending + 4 * (1 + 4), fixed
