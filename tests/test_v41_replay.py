"""DeepSeek-V4.1 SWA bounded replay (docs/MODEL.md §V3-V4): the exactness statements of the
decoder bounded replay (a late layer's row x of a B-row tail ending at S is exact for
x >= S - B + l (W - 1), and generically not below; latents, index keys and layer l0's window
are exact; teacher-forced decode after a W-row tail is exact from S - W + L (W - 1) on;
B >= S equals the full prefill) and of the prefix replay with `row_floor` (rows below the
floor kept, R >= hit exact, R >= n_layers (W - 1) exact after the hit), each against a full
recompute with every layer on every row (`transformer_v41.forward_chunk`)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deepinfer_fn as di
from deepinfer_fn.model import replay_v41 as rv
from deepinfer_fn.model import transformer_v41
from deepinfer_fn.params import init_params
from deepinfer_fn.state import init_v41_state

CFG = di.ModelConfig.preset("v4.1-tiny", index_n_heads=16, hc_sinkhorn_iters=4)
W = CFG.sliding_window                                   # 8
L0 = rv.late_layer_start(CFG)                            # 4
L = CFG.num_hidden_layers - L0                           # 4 late layers
N_LAYERS = CFG.num_hidden_layers
S = 48
CHUNK = 16                                               # the exact reference's extends
# Exact: equal up to the float32 rounding of another program (<= 3e-6 here); a row outside
# the cone differs by more (>= 1.1e-5 right at the boundary, far more below it).
EXACT_TOL = 5e-6


def tokens(seed=0, length=S):
    return np.random.default_rng(seed).integers(3, CFG.image_token_id, length).astype(np.int32)


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(0))


@pytest.fixture(scope="module")
def exact(params):
    """(logits [S, V], state) of a chunked prefill with every layer on every row."""
    state = init_v41_state(CFG, 1, 64)
    return rv.run_sequence(params, state, tokens(), 0, chunk=CHUNK, tail=None)


def row_diff(a, b):
    return np.abs(a - b).max(-1)


def layer_arrays(state):
    return [dict(ls) for ls in state.layers.to_layers()]


def test_late_layer_start_checks_the_config():
    assert L0 == 4
    bad = dataclasses.replace(CFG, engram_layer_ids=(1, 5))
    with pytest.raises(ValueError, match="Engram"):
        rv.late_layer_start(bad)
    with pytest.raises(ValueError, match="candidate source"):
        rv.late_layer_start(dataclasses.replace(CFG, candidate_source_layer_id=2))
    with pytest.raises(ValueError, match="tail must be a positive int"):
        rv.tail_chunk(_ConfigOnly(), init_v41_state(CFG, 1, 16), jnp.zeros((1, 4), jnp.int32),
                      jnp.full((1,), 4), tail=0)


class _ConfigOnly:                                        # tail_chunk checks before any weight
    config = CFG


def test_tail_rows_exact_inside_the_cone(params, exact):
    """One extend of S rows with a B-row tail: rows x >= S - B + L (W - 1) equal the full
    recompute, every tail row below differs; rows before the tail are not computed. Every
    latent, index key, pending pair entry and the window rings (the last W positions, inside
    the cone of every late layer for this B) are exact."""
    B = 36
    want, want_state = exact
    got, state = rv.run_sequence(params, init_v41_state(CFG, 1, 64), tokens(), 0, chunk=S,
                                 tail=B)
    assert np.isnan(got[:S - B]).all() and not np.isnan(got[S - B:]).any()
    d = row_diff(got[S - B:], want[S - B:])
    cone = S - B + L * (W - 1)                           # 40
    assert d[cone - (S - B):].max() <= EXACT_TOL, d
    assert d[:cone - (S - B)].min() > EXACT_TOL, d
    assert int(state.lengths[0]) == S
    assert np.array_equal(np.asarray(state.token_ring), np.asarray(want_state.token_ring))
    for i, (g, w) in enumerate(zip(layer_arrays(state), layer_arrays(want_state))):
        assert g.keys() == w.keys()
        for k in g:
            np.testing.assert_allclose(np.asarray(g[k]), np.asarray(w[k]), atol=1e-5,
                                       err_msg=f"layer {i} {k}")


@pytest.mark.heavy
def test_chunked_tail_prefill_keeps_latents_exact(params, exact):
    """Chunked prefill, every chunk a W-row tail: the latents, index keys, pending pair entries
    and layer l0's window stay exact (layers < l0 and l0's compressor see every row); the
    late layers' windows and the last logits do not."""
    want, want_state = exact
    got, state = rv.run_sequence(params, init_v41_state(CFG, 1, 64), tokens(), 0, chunk=CHUNK,
                                 tail=W)
    for c in range(CHUNK, S + 1, CHUNK):
        assert not np.isnan(got[c - W:c]).any() and np.isnan(got[c - CHUNK:c - W]).all()
    assert row_diff(got[-1], want[-1]) > EXACT_TOL
    for i, (g, w) in enumerate(zip(layer_arrays(state), layer_arrays(want_state))):
        for k in g:
            err = np.abs(np.asarray(g[k], np.float64) - np.asarray(w[k], np.float64)).max()
            if i <= L0 or k == "window_pos":
                assert err <= 1e-5, (i, k, err)
            else:
                assert err > 1e-4, (i, k, err)


def test_row_floor_keeps_rows_below_it(params, exact):
    """forward_chunk(row_floor=f) writes no latent / index-key row at a position < f (a
    sentinel there survives) and writes every row >= f: the first kv source's (its input
    reads no latent) equal the exact rows."""
    _, want_state = exact
    sentinel = 7.0
    state = init_v41_state(CFG, 1, 64)
    layers = state.layers.map_blocks(lambda sc, ls: {
        k: (jnp.full_like(v, sentinel) if k in ("rows", "keys") else v) for k, v in ls.items()})
    state = dataclasses.replace(state, layers=layers)
    floor = 20
    _, state = rv.run_sequence(params, state, tokens(), 0, chunk=CHUNK, tail=None,
                               row_floor=floor)
    first = min(CFG.kv_source_layer_ids)
    for i, (g, w) in enumerate(zip(layer_arrays(state), layer_arrays(want_state))):
        if "rows" not in g:
            continue
        code = CFG.compress_ratio(i)
        below, top = -(-floor // code), S // code        # rows at positions < floor / written
        for k in ("rows", "keys"):
            got = np.asarray(g[k])
            assert (got[:, :below] == sentinel).all(), (i, k)
            assert (got[:, below:top] != sentinel).all() and np.isfinite(got).all(), (i, k)
            if i == first:
                np.testing.assert_array_equal(got[:, below:top], np.asarray(w[k])[:, below:top])


def test_replay_from_zero_is_exact(params, exact):
    """A prefix hit at h replayed with R >= h (every row from position 0, rows kept) gives the
    exact logits after the hit."""
    want, _ = exact
    hit = 32
    got = rv.replay_logits(params, tokens(), hit, hit, tail=None, chunk=CHUNK, max_len=64)
    np.testing.assert_array_equal(got, want[hit:])


# ------------------------------------------------------------------------------ heavy
@pytest.mark.heavy
def test_last_row_error_curve(params, exact):
    """Last-row |dlogit| of a B-row tail for B = W, 2W, ..., S: non-increasing in B, exact
    (to rounding) from B = L (W - 1) + 1 on and at B = S; the disabled flag is exact."""
    want, _ = exact
    curve = {}
    for B in list(range(W, S + 1, W)) + [L * (W - 1) + 1]:
        got = rv.prefill_logits(params, tokens(), tail=B, chunk=S, max_len=64)
        curve[B] = float(row_diff(got[-1], want[-1]))
    Bs = sorted(curve)
    print("last-row |dlogit| by tail B:", {b: f"{curve[b]:.2e}" for b in Bs})
    for b in Bs:
        if b >= L * (W - 1) + 1:
            assert curve[b] <= EXACT_TOL, curve
        else:
            assert curve[b] > EXACT_TOL, curve
    for a, b in zip(Bs, Bs[1:]):
        assert curve[b] <= curve[a] + EXACT_TOL, curve
    off = rv.prefill_logits(params, tokens(), tail=None, chunk=S, max_len=64)
    np.testing.assert_allclose(off[-1], want[-1], atol=EXACT_TOL)


@pytest.mark.heavy
def test_teacher_forced_decode_after_a_window_tail(params):
    """Prefill S rows with a W-row tail, then 3 L W teacher-forced decode steps (every row):
    the logits at x are exact from x >= S - 1 + (L - 1)(W - 1) on and differ before."""
    steps = 3 * L * W
    toks = tokens(1, S + steps)
    want = rv.prefill_logits(params, toks, tail=None, chunk=S, decode_from=S, max_len=256)
    got = rv.prefill_logits(params, toks, tail=W, chunk=S, decode_from=S, max_len=256)
    d = row_diff(got[S:], want[S:])
    first = S - 1 + (L - 1) * (W - 1)                    # = S - W + L (W - 1)
    print("decode |dlogit| by position:", np.array2string(d, precision=1))
    assert d[first - S:].max() <= EXACT_TOL, d
    assert d[:first - S].min() > EXACT_TOL, d


@pytest.mark.heavy
def test_prefix_replay_exact_beyond_all_layers_cone(params):
    """Prefix replay of R rows before the hit (rows kept, rings rebuilt, every layer): exact
    once R >= n_layers (W - 1); with a short R the positions right after the hit differ."""
    n = 96
    hit = 64
    toks = tokens(2, n)
    want = rv.replay_logits(params, toks, hit, None, chunk=CHUNK, max_len=128)
    R = N_LAYERS * (W - 1)                               # 56
    got = rv.replay_logits(params, toks, hit, R, tail=None, chunk=CHUNK, max_len=128)
    assert row_diff(got, want).max() <= EXACT_TOL
    short = rv.replay_logits(params, toks, hit, W, tail=None, chunk=CHUNK, max_len=128)
    assert row_diff(short[:1], want[:1]).min() > EXACT_TOL
    div = rv.replay_divergence(params, toks, hit, W, tail=None, chunk=CHUNK, max_len=128)
    assert div["first_abs"] > EXACT_TOL and len(div["per_position"]) == n - hit


@pytest.mark.heavy
def test_extend_flag_and_whole_extend(params, exact):
    """extend(decoder_swa_bounded_replay=False) is forward_chunk; a tail B >= S of one extend
    from position 0 equals it to rounding, on every row."""
    want, _ = exact
    ids = jnp.asarray(tokens()[None])
    state = init_v41_state(CFG, 1, 64)
    off, _ = rv.extend(params, state, ids, jnp.full((1,), S), decoder_swa_bounded_replay=False,
                       all_logits=True)
    ref, _, _ = transformer_v41.forward_chunk(params, state, ids, jnp.full((1,), S),
                                              all_logits=True)
    np.testing.assert_array_equal(np.asarray(off), np.asarray(ref))
    whole = rv.prefill_logits(params, tokens(), tail=S, chunk=S, max_len=64)
    assert row_diff(whole, want).max() <= EXACT_TOL
