"""DSpark for DeepSeek-V4.1 (docs/MODEL.md §V5; speculative/dspark_v41.py), tiny V4.1, fp32.

* target taps: forward_chunk's features (hc-averaged input residual of a layer, after its
  Engram update) in chunks equal a layer-by-layer no-cache run of the V4.1 stack;
* the draft pass (context rings filled by prefill + commit pushes, ring wrap, lagged mHC
  chain from stream 0, collapse with the last FFN pre, Markov and confidence heads) equals a
  straightforward per-row re-derivation that rebuilds the context from the features of the
  positions P-W..P-1 and runs its own attention with sink;
* heavy (one generate compile each, ~2 min on 2 cores): a planted target (layers' outputs
  scaled by eps, drafter Markov head = the target's bigram table, base logits 0): eps = 0
  accepts every verified draft; eps = 1 greedy DSpark == plain greedy generate (ragged
  prompts, stop tokens) and sampled rows match the plain sampler (chi-square); the
  confidence head is used by verify_len="dynamic"; the params' own mtp stages are the
  default drafter.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deepinfer_fn as di
from deepinfer_fn.config import SWA
from deepinfer_fn.errors import ArgumentError
from deepinfer_fn.layer_groups import layer_kinds
from deepinfer_fn.model import transformer, transformer_v41
from deepinfer_fn.model.attention import kv_projection, output_projection
from deepinfer_fn.model.attention_v41 import empty_shared, query
from deepinfer_fn.model.common import linear, rms_norm
from deepinfer_fn.model.lagged_mhc import statistics
from deepinfer_fn.model.moe import moe_layer
from deepinfer_fn.model.rope import rope_cos_sin, rope_frequencies
from deepinfer_fn.params import dspark_stage_config
from deepinfer_fn.sampling import sampling_params
from deepinfer_fn.speculative import dspark, dspark_v41
from deepinfer_fn.state import init_state
from test_speculative import two_sample_p

# rank = hidden size so the planted drafter's Markov head can hold the target's bigram table;
# 4 Sinkhorn iterations keep the compiles short (the count is not a DSpark matter).
CFG = di.ModelConfig.preset("v4.1-tiny", hc_sinkhorn_iters=4, dspark_markov_rank=64)
GAMMA = CFG.dspark_block_size
W = CFG.sliding_window


@pytest.fixture(scope="module")
def params():
    return di.init_params(CFG, jax.random.key(0))


# --- taps -----------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("taps",))
def _tapped_chunk(params, state, ids, *, taps):
    _, state, _, f = transformer.forward_chunk(
        params, state, ids, jnp.full(ids.shape[:1], ids.shape[1], jnp.int32), taps=taps,
        tap="pre")
    return state, f


def _tapped(params, ids, *, taps, chunk):
    state = init_state(params.config, ids.shape[0], 32)
    feats = []
    for off in range(0, ids.shape[1], chunk):
        state, f = _tapped_chunk(params, state, ids[:, off:off + chunk], taps=taps)
        feats.append(f)
    return jnp.concatenate(feats, 1)


def _reference_taps(params, ids, taps):
    """Layer by layer from position 0 (transformer_v41.layer, no cache); the feature of layer
    i is the mean over streams of its input after its Engram update."""
    cfg = params.config
    B, T = ids.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    row_ids = transformer_v41.engram_row_ids(cfg, ids)
    streams = transformer_v41.embed(params, ids)
    carry = (streams, jnp.broadcast_to(jnp.eye(cfg.hc_mult)[0], (B, T, cfg.hc_mult)),
             empty_shared(cfg, B, T, streams.dtype))
    out = {}
    for i, (kind, _) in enumerate(layer_kinds(cfg)):
        lp = params["layers"][i]
        if i in taps:
            s = transformer_v41.maybe_engram(lp, carry[0], i, kind, ids, row_ids, cfg)
            out[i] = s.mean(2)
        carry = transformer_v41.layer(lp, carry, i, kind, ids, positions, row_ids, cfg)
    return jnp.stack([out[i] for i in taps], 2)


@pytest.mark.parametrize("scan", [True, pytest.param(False, marks=pytest.mark.heavy)])
def test_taps_equal_no_cache_residuals(params, scan):
    """Layers 2 (an Engram layer), 5, 7; chunks of 8 over 16 tokens; the layers scanned (the
    preset) or unrolled."""
    if not scan:
        params = di.init_params(CFG.replace(scan_layers=False), jax.random.key(0))
    taps = (2, 5, 7)
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 250, (2, 16)), jnp.int32)
    want = np.asarray(jax.jit(_reference_taps, static_argnums=2)(params, ids, taps))
    got = np.asarray(_tapped(params, ids, taps=taps, chunk=8))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())
    with pytest.raises(ValueError, match="tap layer ids"):
        transformer.forward_chunk(params, init_state(CFG, 1, 16), ids[:1, :4],
                                  jnp.array([4]), taps=(8,))


# --- the draft pass against a per-row re-derivation -----------------------------------------


def _ref_attention(q, keys, sink, d):
    """q [Q,H,d], keys [C,d], sink [H] -> [Q,H,d]: softmax over keys and the sink."""
    logits = np.einsum("qhd,cd->hqc", q, keys) / np.sqrt(d)
    full = np.concatenate([logits, np.broadcast_to(sink[:, None, None], logits.shape[:2] + (1,))], -1)
    p = np.exp(full - full.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    return np.einsum("hqc,cd->qhd", p[..., :-1], keys)


def _ref_block(d, params, feats_row, P, anchor, drafts):
    """One row's draft block at anchor position P from the features f_t of positions
    max(0, P-W)..P-1 (rebuilt here, no ring), given the drafted tokens [γ] (the Markov
    chain's previous tokens): logits z = base + Markov [γ,V], confidence logits [γ]. Lagged mHC written out: x = norm(sum_j p_j R_j) with p = e_0 first,
    R' = post y + comb^T R, p <- pre of R."""
    cfg = params.config
    scfg = dspark_stage_config(cfg)
    f = lambda x: np.asarray(x, np.float64)
    ctx = np.arange(max(0, P - W), P)
    m = rms_norm(linear(jnp.asarray(feats_row[ctx].reshape(len(ctx), -1)), d["main_proj"]),
                 d["main_norm"], cfg.rms_norm_eps)
    freqs = rope_frequencies(cfg, SWA)
    cc, sc = rope_cos_sin(jnp.asarray(ctx)[None], freqs, jnp.float32)
    pos = P + np.arange(GAMMA)
    cb, sb = rope_cos_sin(jnp.asarray(pos)[None], freqs, jnp.float32)
    ids = np.array([anchor] + [cfg.dspark_noise_token_id] * (GAMMA - 1))
    R = np.repeat(f(params["embed"][ids])[:, None, :], cfg.hc_mult, 1)        # [γ,n,D]
    p = np.zeros((GAMMA, cfg.hc_mult)); p[:, 0] = 1.0
    for sp in d["stages"]:
        kv_ctx = f(kv_projection(sp["attn"], m[None], cc, sc, cfg)[0])

        def attend(x, sp=sp, kv_ctx=kv_ctx):
            xj = jnp.asarray(x, jnp.float32)[None]
            q, _ = query(sp["attn"], xj, cb, sb, scfg)
            kv_blk = f(kv_projection(sp["attn"], xj, cb, sb, scfg)[0])
            o = _ref_attention(f(q[0]), np.concatenate([kv_ctx, kv_blk]), f(sp["attn"]["sinks"]),
                               cfg.head_dim)
            return f(output_projection(sp["attn"], jnp.asarray(o, jnp.float32)[None], cb, sb,
                                       scfg)[0])

        def ffn(x, sp=sp):
            return f(moe_layer(sp["ffn"], jnp.asarray(x, jnp.float32)[None],
                               jnp.asarray(ids)[None], "moe", scfg)[0])

        for hc, norm, fn in ((sp["hc_attn"], sp["attn_norm"], attend),
                             (sp["hc_ffn"], sp["ffn_norm"], ffn)):
            x = f(rms_norm(jnp.asarray((p[:, :, None] * R).sum(1), jnp.float32), norm,
                           cfg.rms_norm_eps))
            y = fn(x)
            pre, post, comb = (f(a) for a in statistics(hc, jnp.asarray(R, jnp.float32), scfg))
            R = post[:, :, None] * y[:, None, :] + np.einsum("tij,tid->tjd", comb, R)
            p = pre
    h = (p[:, :, None] * R).sum(1)                                             # [γ,D]
    hn = f(rms_norm(jnp.asarray(h, jnp.float32), d["norm"], cfg.rms_norm_eps))
    U = hn @ f(params["head"])
    zs, confs = [], []
    for k, prev in enumerate([anchor] + list(drafts[:-1])):
        e = f(d["markov_embed"][prev])
        confs.append(np.concatenate([h[k], e]) @ f(d["confidence"][0]))
        zs.append(U[k] + f(d["markov_head"]) @ e)
    return np.stack(zs), np.array(confs)


@jax.jit
def _pushed_draft(params, d, feats, n_first, P):
    """Prefill-style push of positions 0..n_first-1, then commit-style pushes up to P
    (ragged per row), then the draft pass at P, sampled at temperature 1."""
    B, T = feats.shape[:2]
    ds = dspark_v41.init_draft_state(params.config, B, 64)
    ds = dspark.push(d, params.config, ds, feats, n_first)
    rest = jnp.take_along_axis(feats, jnp.minimum(n_first[:, None] + jnp.arange(T), T - 1)
                               [:, :, None, None], 1)
    ds = dspark.push(d, params.config, ds, rest, P - n_first)
    anchor = jnp.arange(B, dtype=jnp.int32) + 10
    sampling = sampling_params(B, temperature=1.0, seed=np.arange(B))
    return dspark_v41.draft(d, params, ds, anchor, sampling, jnp.zeros((B,), jnp.int32))


def test_draft_pass_matches_reference(params):
    """Rows with P = 3 (< W), 8 and 13 (ring wrapped) and random features."""
    d = dspark_v41.from_params(params)
    B, T = 3, 16
    feats = jax.random.normal(jax.random.key(5), (B, T, 3, CFG.hidden_size))
    n_first = jnp.array([2, 5, 9], jnp.int32)
    P = np.array([3, 8, 13])
    drafts, q, conf = _pushed_draft(params, d, feats, n_first, jnp.asarray(P, jnp.int32))
    drafts, q = np.asarray(drafts), np.asarray(q)
    assert len(np.unique(drafts)) > GAMMA          # sampled, not a constant block
    for b in range(B):
        want_z, want_c = _ref_block(d, params, np.asarray(feats[b]), int(P[b]), 10 + b, drafts[b])
        logp = lambda z: z - z.max(-1, keepdims=True) - np.log(
            np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))
        np.testing.assert_allclose(logp(q[b].astype(np.float64)), logp(want_z), rtol=0,
                                   atol=1e-4 * np.abs(want_z).max())
        np.testing.assert_allclose(np.asarray(conf[b]), want_c, rtol=0,
                                   atol=1e-4 * max(1.0, np.abs(want_c).max()))


def test_bad_input(params):
    with pytest.raises(ArgumentError, match="num_draft_tokens"):
        dspark_v41.resolve(params, None, 3)
    v4 = dspark.init_dspark(CFG, dspark.DSparkConfig.for_target(CFG), jax.random.key(1))
    with pytest.raises(ArgumentError, match="DSparkV41"):
        dspark_v41.resolve(params, v4, None)
    bare = di.Params({**params.weights, "mtp": ()}, CFG)
    with pytest.raises(ArgumentError, match="no DSpark stages"):
        dspark_v41.resolve(bare, None, None)
    bad = dspark_v41.DSparkV41(dspark_v41.from_params(params).weights,
                               jnp.ones((GAMMA,)), (1, 2, 3))
    with pytest.raises(ArgumentError, match="taps layers"):
        dspark_v41.resolve(params, bad, None)
    with pytest.raises(dspark.DSparkError, match="V4.1"):
        dspark_v41.init_dspark_v41(di.ModelConfig.preset("tiny"), jax.random.key(0))


def test_checkpoint_stages_load_as_the_drafter(tmp_path, params):
    """save_params / load_params (unquantized): the mtp.0..2 tensors come back as the same
    drafter; main_proj / main_norm are mtp.0's, norm / Markov / confidence heads mtp.2's."""
    import json
    di.save_params(params, tmp_path / "c")
    names = set(json.loads((tmp_path / "c" / "model.safetensors.index.json").read_text())
                ["weight_map"])
    for n in ("mtp.0.main_proj.weight", "mtp.0.main_norm.weight", "mtp.2.norm.weight",
              "mtp.2.markov_head.embed.weight", "mtp.2.markov_head.head.weight",
              "mtp.2.confidence_head.proj.weight", "mtp.1.attn.wkv.weight"):
        assert n in names, n
    assert not any(n.startswith("mtp.") and "hc_head" in n for n in names)
    model = di.load_model(str(tmp_path / "c"))
    assert model.speculative == ("dspark",)
    a, b = dspark_v41.from_params(params), dspark_v41.from_params(model.params)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ArgumentError, match="mtp"):
        di.load_model(str(tmp_path / "c"), drafter=str(tmp_path))


# --- planted target through generate (heavy) ------------------------------------------------


def planted(eps: float):
    """(target params, drafter): every layer's attention, FFN and Engram output scaled by eps
    (eps = 0: streams stay the embedding, logits = the bigram table norm(embed[y]) @ head);
    the drafter's Markov head is that table and its final-norm weight 0 (base logits 0)."""
    params = di.init_params(CFG, jax.random.key(1))
    w = params.weights

    def scaled(path, x):
        names = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]
        hit = names[-1] in ("wo_b", "w2") or (names[-1] == "wkv" and "engram" in names)
        return x * eps if hit else x

    layers = jax.tree_util.tree_map_with_path(scaled, w["layers"])
    target = di.Params({**w, "layers": layers}, CFG)
    d = dspark_v41.init_dspark_v41(CFG, jax.random.key(2))
    nh = rms_norm(w["embed"], w["norm"], CFG.rms_norm_eps)
    d = dspark_v41.make(CFG, {**d.weights, "markov_embed": nh, "markov_head": w["head"].T,
                              "norm": jnp.zeros_like(d.weights["norm"])}, d.sts_temperatures)
    return target, d


N_NEW = 10
M = 256            # sampled rows per arm
N_GREEDY = 4
TEMP = 0.3         # the random target is flat at T = 1 (~120 effective tokens), ~14 here
STOPS = (7, 42)


def _batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 250, (N_GREEDY + M, 16)).astype(np.int32)
    tokens[N_GREEDY:] = tokens[N_GREEDY]
    lengths = np.array([16, 9, 12, 3] + [14] * M, np.int32)
    temperature = np.array([0.0] * N_GREEDY + [TEMP] * M)
    return tokens, dict(lengths=lengths, max_new_tokens=N_NEW, temperature=temperature,
                        stop_tokens=STOPS, pad_id=0), np.arange(N_GREEDY + M)


@pytest.fixture(scope="module")
def planted_runs():
    tokens, kw, seeds = _batch()
    runs = {}
    for eps in (0.0, 1.0):
        target, d = planted(eps)
        runs[eps] = dict(
            target=target, drafter=d,
            plain=di.generate(target, tokens, seed=seeds + 10_000, **kw),
            spec=di.generate(target, tokens, seed=seeds, speculative="dspark", drafter=d,
                             verify_len="random", **kw))
    runs[1.0]["plain_hot"] = di.generate(target, tokens, seed=seeds + 20_000,
                                         **{**kw, "temperature": kw["temperature"] * 1.5})
    return tokens, kw, runs


@pytest.mark.heavy
def test_planted_target_accepts_every_draft(planted_runs):
    _, _, runs = planted_runs
    out = runs[0.0]["spec"]
    acc, ver = np.asarray(out.accepted), np.asarray(out.verified)
    live = acc >= 0
    assert len(np.unique(ver[live])) == GAMMA + 1
    np.testing.assert_array_equal(acc[live], ver[live])
    np.testing.assert_array_equal(np.asarray(out.tokens)[:N_GREEDY],
                                  np.asarray(runs[0.0]["plain"].tokens)[:N_GREEDY])
    rate1 = runs[1.0]["spec"].acceptance()["acceptance_rate"]
    print(f"\nplanted V4.1: eps=0 {out.acceptance()}, eps=1 rate {rate1:.3f}")
    assert rate1 < 0.95


@pytest.mark.heavy
def test_planted_greedy_equals_plain_greedy(planted_runs):
    _, _, runs = planted_runs
    for eps in (0.0, 1.0):
        sp, plain = runs[eps]["spec"], runs[eps]["plain"]
        np.testing.assert_array_equal(np.asarray(sp.tokens)[:N_GREEDY],
                                      np.asarray(plain.tokens)[:N_GREEDY])
        np.testing.assert_array_equal(np.asarray(sp.lengths)[:N_GREEDY],
                                      np.asarray(plain.lengths)[:N_GREEDY])
        np.testing.assert_array_equal(np.asarray(sp.stopped)[:N_GREEDY],
                                      np.asarray(plain.stopped)[:N_GREEDY])


@pytest.mark.heavy
def test_planted_sampled_matches_plain_distribution(planted_runs):
    _, _, runs = planted_runs
    sp, plain = runs[1.0]["spec"], runs[1.0]["plain"]
    a, b = np.asarray(sp.tokens)[N_GREEDY:], np.asarray(plain.tokens)[N_GREEDY:]
    ps = [two_sample_p(a[:, t], b[:, t]) for t in (1, 2, 4, 7)]
    print(f"\nplanted V4.1 eps=1 sampled: {sp.acceptance()}, p-values {np.round(ps, 3).tolist()}")
    assert min(ps) > 0.01
    assert two_sample_p(np.asarray(sp.stopped)[N_GREEDY:], np.asarray(plain.stopped)[N_GREEDY:],
                        min_count=1) > 0.01
    # the test has power: the plain sampler at 1.5 x the temperature is told apart
    hot = np.asarray(runs[1.0]["plain_hot"].tokens)[N_GREEDY:]
    assert min(two_sample_p(hot[:, t], b[:, t]) for t in (1, 2, 4, 7)) < 0.01


@pytest.mark.heavy
def test_dynamic_verify_length_and_default_drafter(planted_runs):
    """verify_len="dynamic" reads the confidence head: a flat cost verifies every usable
    draft, a steep one none; greedy output stays the plain one. drafter=None runs the
    params' own mtp stages (random: output still the plain greedy one)."""
    from deepinfer_fn.speculative import schedule
    tokens, kw, runs = planted_runs
    target, d = runs[1.0]["target"], runs[1.0]["drafter"]
    rows = slice(0, N_GREEDY)
    plain = np.asarray(runs[1.0]["plain"].tokens)[rows]
    args = dict(lengths=kw["lengths"][rows], max_new_tokens=N_NEW, stop_tokens=STOPS, pad_id=0)
    flat = schedule.flat_cost(GAMMA, 1.0, batches=(1, 8))
    steep = schedule.VerifyCost.from_grid([1, 8], np.tile(2.0 ** np.arange(GAMMA + 1), (2, 1)))
    for name, cost in (("flat", flat), ("steep", steep)):
        out = di.generate(target, tokens[rows], speculative="dspark", drafter=d,
                          verify_len="dynamic", verify_cost=cost, **args)
        np.testing.assert_array_equal(np.asarray(out.tokens), plain)
        conf = np.asarray(out.draft_confidence)
        assert np.all(np.isfinite(conf))
        acc, ver = np.asarray(out.accepted), np.asarray(out.verified)
        for b in range(N_GREEDY):
            count = 1
            for g, v in zip(acc[b][acc[b] >= 0], ver[b][acc[b] >= 0]):
                assert v == (0 if name == "steep" else min(GAMMA, N_NEW - count - 1)), (name, b)
                count += g + 1
    own = di.generate(target, tokens[rows], speculative="dspark", **args)
    np.testing.assert_array_equal(np.asarray(own.tokens), plain)


def test_mtp_is_refused_for_v41():
    """V4.1's mtp.* tensors are DSpark stages: MTP speculation and mtp_forward say so."""
    import deepinfer_fn as di
    from deepinfer_fn.errors import ArgumentError
    from deepinfer_fn.params import init_params
    cfg = di.ModelConfig.preset("v4.1-tiny")
    params = init_params(cfg, jax.random.key(0))
    toks = np.full((1, 4), 3, np.int32)
    with pytest.raises(ArgumentError, match="no MTP block"):
        di.generate(params, toks, max_new_tokens=2, speculative="mtp")
    with pytest.raises(ArgumentError, match="no MTP block"):
        di.mtp_forward(params, toks)
