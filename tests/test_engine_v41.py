"""The offline engine on DeepSeek-V4.1 (`v4.1-tiny`, f32): paged rings, kv-source pools and
token rings (engine/paged_state.py), continuous batching with preemption and multi-step
decode, the prefix cache with bounded replay, and decoder SWA bounded replay on prefill
extends (docs/MODEL.md §V3-V4).

Oracles: `di.generate` per request (bounded replay off: the exact `forward_chunk` prefill),
and `model.replay_v41` run with the engine's chunking (`prefill_logits` for decoder bounded
replay, `replay_logits` for a prefix hit replayed from h - R). Every engine below has the same
device shapes (max_batch 4, 16-token pages, max_len 128, prefill rows [2, 32], decode rows
[4, 1]), so each sub-step compiles once per session (bounded replay adds its prefill).
"""

import functools

import jax
import numpy as np
import pytest

import deepinfer_fn as di
from deepinfer_fn.engine import Engine, Request
from deepinfer_fn.engine.paged_state import init_paged_state, pool_bytes_per_page
from deepinfer_fn.errors import ArgumentError, ArgumentTypeError
from deepinfer_fn.model import replay_v41
from deepinfer_fn.params import init_params

CFG = di.ModelConfig.preset("v4.1-tiny", index_n_heads=16, hc_sinkhorn_iters=4)
W = CFG.sliding_window                                   # 8
N_NEW = 8
CHUNK = 32
MAX_LEN = 128
SHAPES = dict(max_batch=4, page_size=16, max_len=MAX_LEN, prefill_shapes=((2, CHUNK),),
              decode_buckets=(4,), progress=False)
TOL = 2e-4          # logprobs of two programs in f32 (measured <= 2e-6 here)


@functools.cache
def params():
    return init_params(CFG, jax.random.key(0))


def engine(**kw):
    return Engine(params(), **{**SHAPES, **kw})


def tokens(seed, n):
    return np.random.default_rng(seed).integers(3, CFG.image_token_id, n).tolist()


def generate_reference(prompts, temperature, seed, decoder_swa_bounded_replay=False, **kw):
    """`di.generate` on the prompts (one padded [4, 64] batch, so every call shares its
    programs; kw: e.g. speculative=): per prompt (tokens, logprobs) of N_NEW new tokens.
    Decoder bounded replay off by default (every layer on every row), as most engines compared
    with it. Every generate call of this file is this one."""
    B = len(prompts)
    assert B <= 4 and max(map(len, prompts)) <= 64
    rows = list(prompts) + [prompts[0]] * (4 - B)
    toks = np.zeros((4, 64), np.int32)
    for i, p in enumerate(rows):
        toks[i, :len(p)] = p
    pad = lambda v: np.array(list(v) + [v[0]] * (4 - B))
    out = di.generate(params(), toks, lengths=np.array([len(p) for p in rows]),
                      max_new_tokens=N_NEW, temperature=pad(temperature), seed=pad(seed),
                      return_logprobs=True,
                      decoder_swa_bounded_replay=decoder_swa_bounded_replay, **kw)
    t, lp = np.asarray(out.tokens), np.asarray(out.logprobs)
    return [(t[i].tolist(), lp[i]) for i in range(B)]


def logprobs_of(logits, toks):
    """log_softmax(logits [n, V]) at toks [n]."""
    logits = np.asarray(logits, np.float64)
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[:, 0]
    return logits[np.arange(len(toks)), toks] - lse


def check_against_logits(out, logits):
    """An engine output against reference logits [N_NEW, V] of the positions that sampled
    its tokens (greedy: argmax; logprobs equal)."""
    assert out.finish_reason == "length", out
    np.testing.assert_array_equal(out.tokens, np.asarray(logits).argmax(-1))
    np.testing.assert_allclose(out.logprobs, logprobs_of(logits, out.tokens), atol=TOL)


# ------------------------------------------------------------------------------ cheap checks
def test_bad_input_names_the_flag():
    v4 = init_params(di.ModelConfig.preset("tiny"), jax.random.key(0))
    with pytest.raises(ArgumentError, match="decoder_swa_bounded_replay"):
        Engine(v4, decoder_swa_bounded_replay=True, progress=False)
    with pytest.raises(ArgumentTypeError, match="decoder_swa_bounded_replay"):
        engine(decoder_swa_bounded_replay="yes")
    with pytest.raises(ArgumentError, match="engram_max_ngram_size"):
        engine(replay_tokens=CFG.engram_max_ngram_size - 2)
    with pytest.raises(ArgumentError, match="page_size"):
        engine(page_size=15)
    with pytest.raises(ArgumentError, match="mtp"):
        engine(speculative="mtp")
    assert Engine(v4, progress=False, max_len=64).decoder_swa_bounded_replay is False
    assert engine().decoder_swa_bounded_replay is True
    # speculative V4.1 engines: on by default, True accepted, False disables
    for flag, want in ((None, True), (True, True), (False, False)):
        eng = engine(speculative="dspark", decoder_swa_bounded_replay=flag)
        assert eng.decoder_swa_bounded_replay is want and eng.gamma == CFG.dspark_block_size


def test_paged_layout_and_bytes_per_page():
    """Pools only at kv sources, [P, page_size // code, d] / [P, .., d_I]; rings everywhere;
    pool_bytes_per_page == the pools' bytes / P; a default engine gets 16-token pages."""
    P, ps = 5, 16
    st = init_paged_state(CFG, max_batch=3, num_pages=P, page_size=ps, max_pages=4,
                          dtype=np.float32)
    for i in range(CFG.num_hidden_layers):
        pool, ring = st.pools[i], st.slots[i]
        assert set(ring) >= {"window_kv", "window_pos"}
        if i in CFG.kv_source_layer_ids:
            code = CFG.compress_ratio(i)
            assert pool["rows"].shape == (P, ps // code, CFG.head_dim)
            assert pool["keys"].shape == (P, ps // code, CFG.index_head_dim)
            assert ("pend_kv" in ring) == (code == 2)
        else:
            assert pool == {} and set(ring) == {"window_kv", "window_pos"}
    assert st.token_ring.shape == (3, CFG.engram_max_ngram_size)
    assert (np.asarray(st.token_ring) == CFG.engram_pad_token_id).all()
    nbytes = sum(x.nbytes for x in jax.tree.leaves(st.pools))
    assert pool_bytes_per_page(CFG, ps, np.float32) * P == nbytes
    assert engine().page_size == 16


# ------------------------------------------------------------------------- engine == generate
@pytest.mark.heavy
def test_engine_equals_generate_with_preemption_and_multi_step_decode():
    """Greedy and sampled requests, a pool too small for all four at once (preemption by
    recompute, resumed through the prefix cache with R >= the hit: exact), up to 4 decode
    steps per device call: tokens and logprobs == generate per request."""
    prompts = [tokens(s, n) for s, n in ((1, 60), (2, 45), (3, 57), (4, 50))]
    temps, seeds = (0.0, 0.8, 0.0, 1.0), (0, 5, 0, 7)
    want = generate_reference(prompts, temps, seeds)
    eng = engine(num_pages=12, decode_steps=4, max_tokens_per_step=64,
                 decoder_swa_bounded_replay=False)
    outs = eng.generate([Request(p, max_new_tokens=N_NEW, temperature=t, seed=s)
                         for p, t, s in zip(prompts, temps, seeds)])
    assert eng.last_run.preemptions > 0 and eng.last_run.mean_decode_steps > 1
    for out, (toks, lp) in zip(outs, want):
        assert out.tokens == toks
        np.testing.assert_allclose(out.logprobs, lp, atol=TOL)


@pytest.mark.heavy
def test_prefix_hit_exact_and_bounded_replay():
    """A request sharing a 48-token prefix with an earlier one: with R >= the hit it equals
    generate; with R = 5 (rounded to an even start, 6 tokens) it equals `replay_v41`'s
    recipe (cached latents below the hit, replay from h - R with row_floor = h, the token ring
    rebuilt by the replay) and differs from the exact run."""
    system = tokens(9, 48)
    a, b = system + tokens(10, 7), system + tokens(11, 12)
    (want_b, want_lp), = generate_reference([b], [0.0], [0])
    for replay, exact in ((64, True), (5, False)):
        eng = engine(replay_tokens=replay, decoder_swa_bounded_replay=False)
        eng.generate([a], max_new_tokens=2)
        out, = eng.generate([b], max_new_tokens=N_NEW)
        hit = out.metrics.cached_tokens
        assert hit == 48, out.metrics
        assert out.metrics.replayed_tokens == (hit if exact else 6)
        if exact:
            assert out.tokens == want_b
            np.testing.assert_allclose(out.logprobs, want_lp, atol=TOL)
            continue
        seq = b + out.tokens
        ref = replay_v41.replay_logits(params(), seq, hit, 6, chunk=CHUNK, decode_from=len(b),
                                       max_len=MAX_LEN)
        check_against_logits(out, ref[len(b) - 1 - hit:len(b) - 1 - hit + N_NEW])
        assert np.abs(np.array(out.logprobs) - want_lp).max() > 10 * TOL


# ------------------------------------------------------------------ decoder SWA bounded replay
@pytest.mark.heavy
def test_decoder_bounded_replay_matches_replay_v41():
    """Bounded replay on (the V4.1 default): a 20-token prompt prefilled in one extend and a
    50-token one in two (32 + 18) equal `replay_v41.prefill_logits` with the same chunks and a
    W-row tail, then exact decode steps; the long prompt's tail is below the exact bound
    L (W - 1) + 1, so it differs from generate's exact prefill."""
    prompts = [tokens(20, 20), tokens(21, 50)]
    eng = engine()
    outs = eng.generate(prompts, max_new_tokens=N_NEW)
    exact = generate_reference(prompts, [0.0, 0.0], [0, 0])
    for p, out, (_, exact_lp) in zip(prompts, outs, exact):
        ref = replay_v41.prefill_logits(params(), p + out.tokens, tail=W, chunk=CHUNK,
                                        decode_from=len(p), max_len=MAX_LEN)
        check_against_logits(out, ref[len(p) - 1:len(p) - 1 + N_NEW])
    assert np.abs(np.array(outs[1].logprobs) - exact[1][1]).max() > 10 * TOL


@pytest.mark.heavy
def test_decoder_bounded_replay_prefix_hit_re_prefills_the_window():
    """Bounded replay on and R = 4 < W: the hit re-prefills the last W matched tokens (late
    layers' window KV exists only for past tails), as a tail-mode extend from h - W with the
    cached latents kept: == `replay_v41.replay_logits(replay=W, tail=W)`."""
    system = tokens(30, 48)
    a, b = system + tokens(31, 5), system + tokens(32, 10)
    eng = engine(replay_tokens=4)
    eng.generate([a], max_new_tokens=2)
    out, = eng.generate([b], max_new_tokens=N_NEW)
    hit = out.metrics.cached_tokens
    assert hit == 48 and out.metrics.replayed_tokens == W, out.metrics
    seq = b + out.tokens
    ref = replay_v41.replay_logits(params(), seq, hit, W, tail=W, chunk=CHUNK,
                                   decode_from=len(b), max_len=MAX_LEN)
    check_against_logits(out, ref[len(b) - 1 - hit:len(b) - 1 - hit + N_NEW])


# ------------------------------------------------------- speculative, transfer, mesh (heavy)
SPEC_TEMPS, SPEC_SEEDS = (0.0, 1.0, 0.0, 0.8), (0, 3, 0, 9)


def spec_prompts():
    return [tokens(s, n) for s, n in ((40, 20), (41, 13), (42, 37), (43, 28))]


@pytest.mark.heavy
def test_speculative_dspark_engine_equals_generate_speculative():
    """speculative="dspark" on V4.1 (the params' own mtp stages, `dspark_v41`), decoder
    bounded replay off (a 37-token prompt in two chunks): tokens and logprobs ==
    generate(speculative="dspark") per request (same per-request keys); greedy rows == plain
    greedy generate (lossless)."""
    prompts = spec_prompts()
    eng = engine(speculative="dspark", decode_steps=2, decoder_swa_bounded_replay=False)
    assert eng.decoder_swa_bounded_replay is False and eng.gamma == CFG.dspark_block_size
    outs = eng.generate([Request(p, max_new_tokens=N_NEW, temperature=t, seed=s)
                         for p, t, s in zip(prompts, SPEC_TEMPS, SPEC_SEEDS)])
    want = generate_reference(prompts, SPEC_TEMPS, SPEC_SEEDS, speculative="dspark")
    plain = generate_reference(prompts, SPEC_TEMPS, SPEC_SEEDS)
    for i, (out, (toks, lp)) in enumerate(zip(outs, want)):
        assert out.tokens == toks
        np.testing.assert_allclose(out.logprobs, lp, atol=TOL)
        if SPEC_TEMPS[i] == 0.0:
            assert out.tokens == plain[i][0]
    assert eng.last_run.spec_row_steps > 0


@pytest.mark.heavy
def test_speculative_dspark_engine_with_decoder_bounded_replay():
    """speculative="dspark" with decoder bounded replay on (the V4.1 default): prompts that
    both prefill in one chunk (<= 32 tokens: the same W-row tail, the drafter fed its rows)
    give tokens and logprobs == generate(speculative="dspark") with it on; greedy rows ==
    plain greedy generate with it on (verify chunks run every row). The long prompts' tail is
    below the exact bound, so they differ from the exact prefill."""
    prompts = [tokens(s, n) for s, n in ((44, 30), (45, 13), (46, 32), (47, 27))]
    eng = engine(speculative="dspark", decode_steps=2)
    assert eng.decoder_swa_bounded_replay is True
    outs = eng.generate([Request(p, max_new_tokens=N_NEW, temperature=t, seed=s)
                         for p, t, s in zip(prompts, SPEC_TEMPS, SPEC_SEEDS)])
    on = dict(decoder_swa_bounded_replay=True)
    want = generate_reference(prompts, SPEC_TEMPS, SPEC_SEEDS, speculative="dspark", **on)
    plain = generate_reference(prompts, SPEC_TEMPS, SPEC_SEEDS, **on)
    exact = generate_reference(prompts, SPEC_TEMPS, SPEC_SEEDS, speculative="dspark")
    for i, (out, (toks, lp)) in enumerate(zip(outs, want)):
        assert out.tokens == toks
        np.testing.assert_allclose(out.logprobs, lp, atol=TOL)
        if SPEC_TEMPS[i] == 0.0:
            assert out.tokens == plain[i][0]
    assert np.abs(np.array(outs[0].logprobs) - exact[0][1]).max() > 10 * TOL
    assert eng.last_run.spec_row_steps > 0


@pytest.mark.heavy
def test_speculative_prefix_hit_with_decoder_bounded_replay():
    """A speculative engine, bounded replay on, R = 4 < W: the hit re-prefills the last W
    matched tokens through the speculative prefill (drafter fed the tail); greedy tokens and
    logprobs == `replay_v41.replay_logits(replay=W, tail=W)` (lossless verification)."""
    system = tokens(33, 48)
    a, b = system + tokens(34, 5), system + tokens(35, 10)
    eng = engine(speculative="dspark", replay_tokens=4)
    eng.generate([a], max_new_tokens=2)
    out, = eng.generate([b], max_new_tokens=N_NEW)
    hit = out.metrics.cached_tokens
    assert hit == 48 and out.metrics.replayed_tokens == W, out.metrics
    assert eng.last_run.spec_row_steps > 0
    seq = b + out.tokens
    ref = replay_v41.replay_logits(params(), seq, hit, W, tail=W, chunk=CHUNK,
                                   decode_from=len(b), max_len=MAX_LEN)
    check_against_logits(out, ref[len(b) - 1 - hit:len(b) - 1 - hit + N_NEW])


@pytest.mark.heavy
def test_request_state_transfer_equals_one_engine():
    """Engine.prefill in A (bounded replay on), the RequestStates pickled, decoded by B ==
    one engine doing both (token rings and kv-source pages travel with the state)."""
    import pickle
    prompts = [tokens(50, 20), tokens(51, 45), tokens(52, 33)]
    reqs = lambda: [Request(p, max_new_tokens=N_NEW, temperature=t, seed=s, request_id=i)
                    for i, (p, t, s) in enumerate(zip(prompts, (0.0, 1.0, 0.7), (0, 4, 8)))]
    want = engine().generate(reqs())
    states = pickle.loads(pickle.dumps(engine().prefill(reqs())))
    assert all(s.rings[-1].shape == (CFG.engram_max_ngram_size,) for s in states)
    got = engine().generate(states)
    for a, b in zip(want, got):
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=TOL)


@pytest.mark.heavy
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
def test_engine_on_a_mesh_equals_one_device():
    """dp=2 x ep=4 (8 batch shards, one slot each, bounded replay on): tokens and logprobs ==
    the single-device engine's, greedy and sampled."""
    import shardings
    prompts = [tokens(60 + i, n) for i, n in enumerate((20, 13, 37, 25, 30, 18, 9, 40))]
    reqs = [Request(p, max_new_tokens=6, temperature=0.0 if i % 2 else 1.0, seed=i)
            for i, p in enumerate(prompts)]
    kw = dict(max_batch=8, page_size=16, max_len=MAX_LEN, prefill_shapes=((8, CHUNK),),
              decode_buckets=(8,), progress=False)
    mesh_params = shardings.shard_params(params(), shardings.make_mesh(dp=2, ep=4))
    got = Engine(mesh_params, **kw).generate(reqs)
    want = Engine(params(), **kw).generate(reqs)
    for a, b in zip(want, got):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=TOL)
