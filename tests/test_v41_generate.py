"""`generate` / `stream_generate` on DeepSeek-V4.1 (tiny V4.1, fp32, random weights).

Default suite (~45 s on 2 cores):
* `tail_chunk(taps=)`: the tail rows' features equal the exact forward's where the cone says
  they must (early layers at every tail row, the first late layer at the last row) and not
  below it;
* the decoder_swa_bounded_replay checks (type, V4 models, V4.1 configs whose layers do not
  allow it) raise before anything compiles; `generate_programs` picks the prefill program.

Heavy (each a few generate compiles, ~1-3 min on 2 loaded cores):
* decoder SWA bounded replay (docs/MODEL.md §V3-V4, default on for V4.1): greedy tokens and
  logprobs of `generate` equal a reference built from `replay_v41.prefill_logits` (the same
  chunk width, tail = sliding_window, then teacher-forced decode steps), with a ragged batch
  and a prompt longer than prefill_chunk whose last chunk is shorter than the window (its
  floor reaches into the previous chunk's tail); the reference differs from the exact prefill,
  so the check can fail. Off: the exact path (each logprob the no-cache forward's).
* `stream_generate` pieces (plain and DSpark) add up to `generate`; greedy DSpark (the params'
  own mtp stages) == plain greedy; the drafter's context after the bounded-replay prefill
  holds the last W positions, exact where the tail is the whole extend;
* constrained V4.1 rows match their regex and equal a brute-force masked argmax over the
  bounded-replay reference; DSpark under the constraint gives the same tokens;
* generate on a dp=2 x ep=4 mesh (8 fake CPU devices) equals one device.

The plain tests share one shape (batch 2, prompts of 20 columns, prefill_chunk 16, 6 new
tokens: capacity 256): generate with the flag on and off shares its decode program,
stream_generate its prefill program.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deepinfer_fn as di
from deepinfer_fn.decoding.checks import check_bounded_replay
from deepinfer_fn.errors import ArgumentError, ArgumentTypeError
from deepinfer_fn.generate import generate_programs
from deepinfer_fn.model import replay_v41 as rv
from deepinfer_fn.model import transformer_v41
from deepinfer_fn.state import init_v41_state

CFG = di.ModelConfig.preset("v4.1-tiny", index_n_heads=16, hc_sinkhorn_iters=4)
W = CFG.sliding_window                       # 8
T, CHUNK, N = 20, 16, 6                      # chunks of 16 + 4 (< W) for the long row
LENGTHS = np.array([20, 4], np.int32)        # the short row ends in the first chunk
CAPACITY = 256                               # generate's bucket of 20 + 6
TOL = 2e-5                                   # two programs' float32 rounding


@pytest.fixture(scope="module")
def params():
    return di.init_params(CFG, jax.random.key(0))


@pytest.fixture(scope="module")
def prompts():
    return np.random.default_rng(0).integers(3, CFG.image_token_id, (2, T)).astype(np.int32)


@pytest.fixture(scope="module")
def on(params, prompts):
    return di.generate(params, prompts, lengths=LENGTHS, max_new_tokens=N, prefill_chunk=CHUNK,
                       return_logprobs=True)


def _log_softmax(x):
    return np.asarray(jax.nn.log_softmax(jnp.asarray(x, jnp.float32), axis=-1))


def _rows(prompts, out):
    """Per row: prompt + generated tokens (numpy)."""
    return [np.concatenate([prompts[b, :LENGTHS[b]], np.asarray(out.tokens[b])])
            for b in range(len(LENGTHS))]


@pytest.mark.heavy   # generate + reference compiles (~3 min on 2 loaded cores)
def test_bounded_replay_equals_tail_reference(params, prompts, on):
    """Default (None) = on for V4.1: each greedy token is the argmax of the reference's
    logits (chunked tail prefill, teacher-forced decode) and its logprob their log-softmax;
    the reference's last prompt row differs from the exact prefill's."""
    for b, seq in enumerate(_rows(prompts, on)):
        L = int(LENGTHS[b])
        ref = rv.prefill_logits(params, seq, tail=W, chunk=CHUNK, decode_from=L,
                                max_len=CAPACITY)[L - 1:L - 1 + N]
        np.testing.assert_array_equal(np.asarray(on.tokens[b]), ref.argmax(-1))
        want = np.take_along_axis(_log_softmax(ref), np.asarray(on.tokens[b])[:, None], 1)[:, 0]
        np.testing.assert_allclose(np.asarray(on.logprobs[b]), want, atol=TOL)
    # the tail changes the long row's prompt logits: the comparison above can fail
    seq = _rows(prompts, on)[0]
    exact = np.asarray(di.forward(params, seq[None, :T]))[0, T - 1]
    tail = rv.prefill_logits(params, seq[:T], tail=W, chunk=CHUNK, max_len=CAPACITY)[T - 1]
    assert np.abs(exact - tail).max() > 100 * TOL


@pytest.mark.heavy
def test_flag_off_is_the_exact_path(params, prompts, on):
    """decoder_swa_bounded_replay=False: every logprob is the no-cache forward's over the
    prompt and the tokens before it (the argmax roll-out), and differs from the bounded
    replay's on the long row."""
    off = di.generate(params, prompts, lengths=LENGTHS, max_new_tokens=N, prefill_chunk=CHUNK,
                      return_logprobs=True, decoder_swa_bounded_replay=False)
    seqs = _rows(prompts, off)
    full = np.zeros((2, T + N), np.int32)
    for b, s in enumerate(seqs):
        full[b, :len(s)] = s
    logits = np.asarray(di.forward(params, full))           # causal: right padding is inert
    for b in range(2):
        L = int(LENGTHS[b])
        lg = logits[b, L - 1:L - 1 + N]
        np.testing.assert_array_equal(np.asarray(off.tokens[b]), lg.argmax(-1))
        want = np.take_along_axis(_log_softmax(lg), np.asarray(off.tokens[b])[:, None], 1)[:, 0]
        np.testing.assert_allclose(np.asarray(off.logprobs[b]), want, atol=TOL)
    assert np.abs(np.asarray(off.logprobs[0]) - np.asarray(on.logprobs[0])).max() > 10 * TOL


@pytest.mark.heavy
def test_tail_chunk_taps_follow_the_cone(params, prompts):
    """tail_chunk(taps=) vs forward_chunk(taps=) over one 16-row extend with a W-row tail:
    features at the tail rows, exact for the layers before the late stack (1: an Engram layer;
    4 = l0: its input) at every tail row, for the first late one (5: l0's output) from
    S - B + (W - 1) = the last row on, and generically not below (6, at the tail's first row)."""
    S, taps = 16, (1, 4, 5, 6)
    ids = jnp.asarray(prompts[:1, :S])
    n = jnp.full((1,), S, jnp.int32)
    _, _, _, feats = jax.jit(lambda p, s: transformer_v41.forward_chunk(
        p, s, ids, n, all_logits=True, taps=taps))(params, init_v41_state(CFG, 1, 64))
    lt, _, st, ft = jax.jit(lambda p, s: rv.tail_chunk(p, s, ids, n, tail=W, all_logits=True,
                                                       taps=taps))(params,
                                                                   init_v41_state(CFG, 1, 64))
    assert ft.shape == (1, W, len(taps), CFG.hidden_size) and st.shape[:2] == (1, W)
    ft, feats = np.asarray(ft), np.asarray(feats)
    np.testing.assert_allclose(ft[:, :, :2], feats[:, S - W:, :2], atol=1e-5)
    np.testing.assert_allclose(ft[:, -1, 2], feats[:, -1, 2], atol=1e-5)
    assert np.abs(ft[0, 0, 3] - feats[0, S - W, 3]).max() > 1e-4
    assert np.abs(ft[0, 0, 2] - feats[0, S - W, 2]).max() > 1e-4
    assert lt.shape == (1, W, CFG.vocab_size) and np.isfinite(np.asarray(lt)).all()


def test_flag_checks_before_compiling(params, prompts):
    v4 = di.init_params(di.ModelConfig.preset("tiny"), jax.random.key(0))
    with di.ProgramCounter() as counter:
        for call in (lambda **kw: di.generate(v4, prompts, max_new_tokens=2, **kw),
                     lambda **kw: di.stream_generate(v4, prompts, max_new_tokens=2, **kw),
                     lambda **kw: generate_programs(v4, 2, T, 2, **kw)):
            with pytest.raises(ArgumentError, match="decoder_swa_bounded_replay=True"):
                call(decoder_swa_bounded_replay=True)
        for bad in ("yes", 1):
            with pytest.raises(ArgumentTypeError, match="decoder_swa_bounded_replay"):
                di.generate(params, prompts, max_new_tokens=2, decoder_swa_bounded_replay=bad)
            with pytest.raises(ArgumentTypeError, match="decoder_swa_bounded_replay"):
                di.stream_generate(params, prompts, max_new_tokens=2,
                                   decoder_swa_bounded_replay=bad)
    assert counter.programs == 0
    assert check_bounded_replay(CFG, None) and not check_bounded_replay(CFG, False)
    assert not check_bounded_replay(v4.config, None) and not check_bounded_replay(v4.config, False)
    late_engram = dataclasses.replace(CFG, engram_layer_ids=(1, 5))
    assert not check_bounded_replay(late_engram, None)      # this layout cannot: off
    with pytest.raises(ArgumentError, match="Engram"):
        check_bounded_replay(late_engram, True)
    jobs = generate_programs(params, 2, T, N, prefill_chunk=CHUNK)
    assert [j.kwargs.get("bounded_replay") for j in jobs[1:2]] == [True]
    jobs = generate_programs(params, 2, T, N, prefill_chunk=CHUNK,
                                decoder_swa_bounded_replay=False)
    assert [j.kwargs.get("bounded_replay") for j in jobs[1:2]] == [False]


# --- streaming and speculative (heavy) -------------------------------------------------------


@pytest.mark.heavy
def test_stream_generate_pieces_add_up(params, prompts, on):
    pieces = list(di.stream_generate(params, prompts, lengths=LENGTHS, max_new_tokens=N,
                                     prefill_chunk=CHUNK, block=4))
    assert len(pieces) == 2
    got = np.concatenate([np.asarray(p.tokens) for p in pieces], axis=1)
    np.testing.assert_array_equal(got, np.asarray(on.tokens))


@pytest.mark.heavy
def test_dspark_greedy_and_stream_under_bounded_replay(params, prompts, on):
    """speculative="dspark" (the params' mtp stages), prefill with bounded replay and the
    drafter fed the tail rows' taps: greedy tokens == plain greedy (same prefill, exact verify
    chunks); stream pieces add up to generate's tokens; some drafts are verified."""
    kw = dict(lengths=LENGTHS, max_new_tokens=N, prefill_chunk=CHUNK, speculative="dspark")
    spec = di.generate(params, prompts, **kw)
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(on.tokens))
    assert (np.asarray(spec.verified) > 0).any()
    pieces = list(di.stream_generate(params, prompts, block=3, **kw))
    got = [np.concatenate([np.asarray(p.tokens[b, :int(p.lengths[b])]) for p in pieces])
           for b in range(2)]
    for b in range(2):
        np.testing.assert_array_equal(got[b], np.asarray(spec.tokens[b, :int(spec.lengths[b])]))


@pytest.mark.heavy
def test_dspark_prefill_context_from_the_tail(params, prompts):
    """The drafter's context after a bounded-replay speculative prefill holds each row's last
    W prompt positions; the short row (one extend of 4 <= W rows: its tail is the whole
    extend, exact) has exactly the exact prefill's context, the long row an approximation."""
    from deepinfer_fn.decoding.speculative import spec_prefill
    from deepinfer_fn.speculative import registry
    kind = registry.get("dspark")
    weights, k = kind.resolve(params, None, None)

    def context(bounded):
        state = init_v41_state(CFG, 2, CAPACITY, window_slots=W + k)
        dstate = kind.init_state(params, weights, 2, CAPACITY, window_slots=W + k, k=k,
                                 dtype=jnp.float32)
        _, _, dstate = spec_prefill(params, kind, weights, state, dstate, prompts, LENGTHS,
                                    CHUNK, bounded_replay=bounded)
        return ([np.asarray(ls["window_pos"]) for ls in dstate.layers],
                [np.asarray(ls["window_kv"]) for ls in dstate.layers])

    (pos_t, kv_t), (pos_x, kv_x) = context(True), context(False)
    for pt, px, kt, kx in zip(pos_t, pos_x, kv_t, kv_x):
        np.testing.assert_array_equal(pt, px)
        assert sorted(pt[0]) == list(range(T - W, T))
        assert sorted(pt[1][pt[1] >= 0]) == list(range(LENGTHS[1]))
        np.testing.assert_allclose(kt[1], kx[1], atol=1e-5)
        assert np.abs(kt[0] - kx[0]).max() > 1e-4


@pytest.mark.heavy
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
def test_generate_on_mesh_equals_single_device(params, prompts, on):
    """dp=2 x ep=4 (batch over 8 shards, padded; experts over ep), bounded replay on."""
    import shardings
    sharded = shardings.shard_params(params, shardings.make_mesh(dp=2, ep=4))
    out = di.generate(sharded, prompts, lengths=LENGTHS, max_new_tokens=N, prefill_chunk=CHUNK,
                      return_logprobs=True)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(on.tokens))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(on.logprobs), atol=TOL)


# --- structured output: a byte-level BPE and a V4.1 model over its vocabulary ---------------

EXTRA_IDS = 16      # model ids past the tokenizer (the image and noise ids among them)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    pytest.importorskip("llguidance")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from deepinfer_fn import text
    rng = np.random.default_rng(0)
    corpus = [" ".join(str(int(x)) for x in rng.integers(0, 999, 8)) + " the name is ok"
              for _ in range(200)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=text.chat_special_tokens(),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(corpus, trainer)
    directory = tmp_path_factory.mktemp("bpe41")
    bpe.save(str(directory / "tokenizer.json"))
    return text.load_tokenizer(directory)


@pytest.mark.heavy
def test_constrained_rows_equal_masked_argmax_reference(tok):
    """Greedy constrained V4.1 rows (bounded replay on) under a regex: the text fully matches,
    and each token is the argmax of the bounded-replay reference's logits (teacher-forced)
    restricted to the tokens a fresh matcher allows after the tokens before it. A free row
    beside them is unchanged. Greedy DSpark under the same constraint gives the same tokens."""
    import re
    from deepinfer_fn import structured
    from deepinfer_fn.structured import Matcher, Regex
    V = tok.vocab_size + EXTRA_IDS
    cfg = di.ModelConfig.preset("v4.1-tiny", index_n_heads=16, hc_sinkhorn_iters=4,
                                vocab_size=V, eos_token_id=tok.eos_id, image_token_id=V - 1,
                                dspark_noise_token_id=V - 2, engram_compressed_vocab_size=V)
    params = di.init_params(cfg, jax.random.key(3))
    pattern = r"[0-9]{2,5}( ok)?"
    prompts = np.asarray([(tok.encode("the name is 12 ") * 8)[:12]] * 2, np.int32)
    prompts[1, 3] = 40
    kw = dict(max_new_tokens=8, prefill_chunk=8, tokenizer=tok, return_logprobs=True)
    out = di.generate(params, prompts, constraint=[Regex(pattern), None], **kw)
    free = di.generate(params, prompts, **{k: v for k, v in kw.items() if k != "tokenizer"})
    np.testing.assert_array_equal(np.asarray(out.tokens[1]), np.asarray(free.tokens[1]))
    assert out.constraint_status[0] == "complete", out.constraint_status
    n = int(out.lengths[0])
    ids = np.asarray(out.tokens[0, :n]).tolist()
    assert ids[-1] == tok.eos_id and re.fullmatch(pattern, tok.decode(ids[:-1]))
    ref = rv.prefill_logits(params, np.concatenate([prompts[0], ids]), tail=cfg.sliding_window,
                            chunk=8, decode_from=12, max_len=256)[11:11 + n]
    m = Matcher(Regex(pattern), tok, V)
    for t, token in enumerate(ids):
        allowed = structured.unpack_mask(m.allowed_mask(), V)
        assert allowed.sum() < V - EXTRA_IDS                   # the mask bites
        assert token == int(np.where(allowed, ref[t], -np.inf).argmax()), t
        assert m.consume(token)
    spec = di.generate(params, prompts, constraint=[Regex(pattern), None], speculative="dspark",
                       **kw)
    np.testing.assert_array_equal(np.asarray(spec.tokens[0, :n]), np.asarray(ids))
    assert spec.constraint_status[0] == "complete"
