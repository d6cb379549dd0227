"""DeepSeek-V4.1 decoder SWA bounded replay (docs/MODEL.md §V3-V4) and the prefix-cache
replay of V4.1 states, measured against exact prefills.

Decoder bounded replay (default on for every non-speculative extend; `tail=None` or
`decoder_swa_bounded_replay=False` disables it): the late stack starts at the last kv source
l0 = max(kv_source_layer_ids). One extend of n rows ending at seq_len:

  1. layers 0 .. l0-1 on all rows (exact);
  2. layer l0's attention input on all rows, its compressor writes latents and index keys for
     every row (exact);
  3. layers l0 .. end (attention incl. l0's selection and candidate publish, MoE) on the tail
     only, the last min(B, n) rows, their window floored at max(0, seq_len - B); late-layer
     window KV is written for tail rows only;
  4. final collapse, norm and head on the tail rows.

Decode steps and verify chunks run every layer on every row (`transformer_v41.forward_chunk`).
A speculative prefill (`generate` and the engine) runs `tail_extend`: the drafter's prefill
gets the tail rows' features and their positions / ids (`tail_inputs`), all that its
window-wide context holds.
A late layer's output at row x of a B-row tail ending at S is exact for x >= S - B + l (W - 1)
(l = 1 for layer l0, 2 for the next, ...): the last prompt row is exact when
B >= L (W - 1) + 1 (L late layers), a teacher-forced decode after the tail from
x >= S - B + L (W - 1) on, and B >= S (one extend from position 0) equals the full prefill.

Prefix replay (`replay_logits`, as the V4 engine does it, `engine/replay.py`): a hit at h keeps
the cached latents and index keys of positions < h and rebuilds the rings by replaying tokens
h-R .. h-1 through every layer with row writes below h suppressed (`row_floor`); the decoder
tail applies on top when enabled. R >= h is exact.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_fn.config import HASH_MOE, ModelConfig
from deepinfer_fn.layer_groups import LayerStack, as_stack, layer_groups
from deepinfer_fn.model import engram, transformer_v41
from deepinfer_fn.model.attention_v41 import empty_shared
from deepinfer_fn.model.cached_v41 import chunk_positions, ring_write, source_update
from deepinfer_fn.model.common import rms_norm
from deepinfer_fn.model.lagged_mhc import initial_pending
from deepinfer_fn.model.mhc_math import collapse
from deepinfer_fn.state import V41DecodeState, init_v41_state


def late_layer_start(cfg: ModelConfig) -> int:
    """l0 = max(kv_source_layer_ids), with the conditions under which the late stack
    l0 .. end may run on a tail: later layers have codes 0 / 1 and own no compressor, l0 is an
    index source and the candidate source (if any), and no Engram or hash-routed layer is
    >= l0. Raises ValueError naming the violated condition."""
    if not cfg.is_v41 or not cfg.kv_source_layer_ids:
        raise ValueError("decoder bounded replay needs a DeepSeek-V4.1 config with kv sources")
    l0 = max(cfg.kv_source_layer_ids)
    n = cfg.num_hidden_layers
    bad = [i for i in range(l0 + 1, n) if cfg.compress_ratio(i) not in (0, 1)]
    if bad:
        raise ValueError(f"decoder bounded replay: layers {bad} after the last kv source {l0} "
                         "must have codes 0 or 1")
    if l0 not in cfg.index_source_layer_ids:
        raise ValueError(f"decoder bounded replay: the last kv source {l0} must be an index "
                         "source")
    if cfg.candidate_source_layer_id >= 0 and cfg.candidate_source_layer_id != l0:
        raise ValueError(f"decoder bounded replay: the candidate source "
                         f"{cfg.candidate_source_layer_id} must be the last kv source {l0}")
    if any(i >= l0 for i in cfg.engram_layer_ids):
        raise ValueError(f"decoder bounded replay: Engram layers {cfg.engram_layer_ids} must "
                         f"lie before layer {l0}")
    if any(cfg.mlp_layer_types[i] == HASH_MOE for i in range(l0, n)):
        raise ValueError(f"decoder bounded replay: no hash-routed layer may be >= {l0}")
    return l0


def _engram_rows(params, state, token_ids, token_map):
    cfg = params.config
    if not cfg.engram_layer_ids:
        return None
    consts = engram.HashConstants.from_config(cfg)
    token_map = transformer_v41.default_token_map(cfg) if token_map is None else token_map
    return engram.hash_ids(token_ids, transformer_v41.chunk_history(state, consts),
                           jnp.asarray(token_map, jnp.int32), consts)


def tail_columns(n_new: jax.Array, width: int, tail: int):
    """The tail of a chunk of `width` columns with n_new [B] valid ones: (first [B], the
    first tail column n_new - min(tail, n_new); n_tail [B] = min(tail, n_new); cols int32
    [B, min(tail, width)], the chunk column of each tail row, clipped into the chunk)."""
    St = min(tail, width)
    n_tail = jnp.minimum(n_new, tail)
    first = n_new - n_tail
    cols = jnp.clip(first[:, None] + jnp.arange(St, dtype=jnp.int32)[None], 0, width - 1)
    return first, n_tail, cols


def take_columns(a: jax.Array, cols: jax.Array) -> jax.Array:
    """a [B, S, ...] at the columns cols [B, St] -> [B, St, ...]."""
    return jnp.take_along_axis(a, cols.reshape(cols.shape + (1,) * (a.ndim - 2)), axis=1)


def tail_inputs(start: jax.Array, token_ids: jax.Array, n_new: jax.Array, next_ids=None,
                n_next=None, *, tail: int):
    """What a drafter's prefill sees of a bounded-replay extend (`tail_chunk` with `tail`
    rows): the chunk's tail rows only. start [B]: the state length before the chunk;
    token_ids [B, S] with n_new [B] valid; next_ids [B, S] / n_next [B]: the token after each
    of the chunk's first n_next positions, or None (unknown). Returns (lengths [B] = start +
    first, the tail's first position; ids int32 [B, St]; n_tail [B]; the tail's next ids
    [B, St] and n_next [B], or None, None), St = min(tail, S) as `tail_columns`."""
    first, n_tail, cols = tail_columns(n_new, token_ids.shape[1], tail)
    ids = take_columns(token_ids, cols)
    if next_ids is None:
        return start + first, ids, n_tail, None, None
    return (start + first, ids, n_tail, take_columns(next_ids, cols),
            jnp.clip(n_next - first, 0, None))


def tail_chunk(params, state: V41DecodeState, token_ids: jax.Array, n_new: jax.Array, *,
               tail: int, all_logits: bool = False, row_floor=None, token_map=None,
               taps: tuple[int, ...] | None = None, tap: str = "pre"):
    """One extend with decoder SWA bounded replay (module docstring, steps 1-4).

    token_ids [B, S] int32 (entries past n_new[b] padding); n_new [B] in [0, S]; tail: B_t >= 1
    rows. row_floor [B] (optional): as `transformer_v41.forward_chunk`. Returns (logits, new
    state): logits float32 [B, min(B_t, S), V] of the tail rows (tail row i is chunk column
    n_new - min(B_t, n_new) + i, `tail_columns`; rows past the tail length are padding) if
    all_logits, else those of each row's last valid token [B, V].

    taps (layer ids, as `transformer_v41.forward_chunk`): returns (logits, new state, streams,
    features) instead, streams [B, St, n, D] the tail rows' final residual streams and features
    [B, St, len(taps), D] the tapped layers' stream means at the tail rows (St = min(B_t, S);
    a late layer's features exist only there, which is all a window-wide drafter context
    needs)."""
    cfg = params.config
    if not isinstance(state, V41DecodeState):
        raise TypeError(f"tail_chunk: needs a state.V41DecodeState, got {type(state).__name__}")
    if not isinstance(tail, int) or tail < 1:
        raise ValueError(f"tail_chunk: tail must be a positive int, got {tail!r}")
    l0 = late_layer_start(cfg)
    if taps is not None:
        transformer_v41.check_taps(cfg, taps, tap)
    tap_set, tapped = set(taps or ()), {}
    B, S = token_ids.shape
    token_ids = jnp.clip(token_ids, 0, cfg.vocab_size - 1).astype(jnp.int32)
    n_new = n_new.astype(jnp.int32)
    start = state.lengths
    seq_len = start + n_new
    if row_floor is not None:
        row_floor = jnp.broadcast_to(jnp.asarray(row_floor, jnp.int32), (B,))
    row_ids = transformer_v41.engram_inputs(params, _engram_rows(params, state, token_ids,
                                                                  token_map))
    groups = layer_groups(cfg)
    players = as_stack(groups, params["layers"])
    slayers = as_stack(groups, state.layers)
    kinds = [k for k, _ in cfg.layer_kinds()]
    new_layers = []

    # 1. layers 0 .. l0-1 on all rows
    streams = transformer_v41.embed(params, token_ids)
    carry = (streams, initial_pending((B, S), cfg.hc_mult),
             empty_shared(cfg, B, S, streams.dtype, capacity=state.max_len))
    for i in range(l0):
        kind = kinds[i]
        if i in tap_set:                      # "pre": the input after the Engram update
            streams, pending, shared = carry
            streams = transformer_v41.maybe_engram(players[i], streams, i, kind, token_ids,
                                                   row_ids, cfg)
            carry, kind = (streams, pending, shared), transformer_v41.without_engram(kind)
            tapped[i] = streams
        carry, ls = transformer_v41.layer_chunk(players[i], slayers[i], carry, i, kind,
                                                token_ids, row_ids, start, n_new, cfg,
                                                row_floor=row_floor)
        if i in tap_set and tap == "post":
            tapped[i] = carry[0]
        new_layers.append(ls)
    streams, pending, shared = carry

    # 2. layer l0's compressor on all rows (its attention input is the collapse of step 3's)
    lp, ls = players[l0], slayers[l0]
    x = rms_norm(collapse(streams, pending), lp["attn_norm"], cfg.rms_norm_eps)
    pos, valid = chunk_positions(start, n_new, S)
    ls = {**ls, **source_update(lp["attn"], ls, x, pos, valid, cfg.compress_ratio(l0), cfg,
                                row_floor)}

    # 3. the tail: the last min(tail, n_new) rows of each sequence
    St = min(tail, S)
    first, n_tail, cols = tail_columns(n_new, S, tail)
    take = functools.partial(take_columns, cols=cols)
    tapped = {i: take(f) for i, f in tapped.items()}      # early taps: at the tail rows
    ids_t = take(token_ids)
    fresh = empty_shared(cfg, B, St, streams.dtype, capacity=state.max_len)
    carry = (take(streams), take(pending), {**fresh, "latents": shared["latents"]})
    floor = jnp.maximum(seq_len - tail, 0)
    for i in range(l0, cfg.num_hidden_layers):           # no Engram here (late_layer_start)
        if i in tap_set and tap == "pre":
            tapped[i] = carry[0]
        carry, ls = transformer_v41.layer_chunk(
            players[i], ls if i == l0 else slayers[i], carry, i, kinds[i], ids_t, None,
            start + first, n_tail, cfg, row_floor=seq_len, window_floor=floor)
        if i in tap_set and tap == "post":
            tapped[i] = carry[0]
        new_layers.append(ls)
    streams, pending, _ = carry

    tokens = ring_write(state.token_ring, pos, token_ids, valid)
    new_state = V41DecodeState(LayerStack.from_layers(groups, new_layers), tokens, seq_len,
                               state.max_len, state.window_slots)
    extra = () if taps is None else (streams, jnp.stack(
        [tapped[i].mean(axis=2) for i in taps], axis=2) if taps else
        jnp.zeros(streams.shape[:2] + (0, streams.shape[-1]), streams.dtype))
    # 4. head on the tail rows
    if all_logits:
        return (transformer_v41.head_logits(params, streams, pending), new_state) + extra
    last = jnp.clip(n_tail - 1, 0, St - 1)
    pick = lambda a: jnp.take_along_axis(a, last.reshape((B, 1) + (1,) * (a.ndim - 2)), axis=1)
    return (transformer_v41.head_logits(params, pick(streams), pick(pending))[:, 0],
            new_state) + extra


def extend(params, state: V41DecodeState, token_ids: jax.Array, n_new: jax.Array, *,
           decoder_swa_bounded_replay: bool = True, tail: int | None = None,
           all_logits: bool = False, row_floor=None, token_map=None,
           taps: tuple[int, ...] | None = None, tap: str = "pre"):
    """A non-speculative extend (prefill chunk) of a V4.1 state: with decoder SWA bounded
    replay (default; tail rows B_t = tail, default sliding_window) or, disabled, every layer on
    every row. Returns (logits, new state); all_logits: logits of the tail rows [B, St, V]
    (`tail_chunk`) resp. of every row [B, S, V]. taps: (logits, new state, streams, features)
    of the tail rows resp. of every row [B, S, ...]."""
    if decoder_swa_bounded_replay:
        tail = params.config.sliding_window if tail is None else tail
        return tail_chunk(params, state, token_ids, n_new, tail=tail, all_logits=all_logits,
                          row_floor=row_floor, token_map=token_map, taps=taps, tap=tap)
    out = transformer_v41.forward_chunk(
        params, state, token_ids, n_new, all_logits=all_logits, token_map=token_map,
        row_floor=row_floor, taps=taps, tap=tap)
    return out[:2] if taps is None else out


def tail_extend(params, state: V41DecodeState, token_ids: jax.Array, n_new: jax.Array,
                next_ids=None, n_next=None, *, tail: int | None = None, row_floor=None,
                taps: tuple[int, ...] = (), tap: str = "pre"):
    """A bounded-replay extend (`tail_chunk`, tail default sliding_window) as a drafter's
    prefill reads it (speculative prefill in `generate` and the engine): (logits [B, V], new
    state, streams [B, St, n, D], features [B, St, len(taps), D] of the tail rows, view) with
    view = `tail_inputs(state.lengths, token_ids, n_new, next_ids, n_next)`, the tail's
    positions, ids and next ids that the features belong to."""
    tail = params.config.sliding_window if tail is None else tail
    out = extend(params, state, token_ids, n_new, tail=tail, row_floor=row_floor, taps=taps,
                 tap=tap)
    return out + (tail_inputs(state.lengths, token_ids, n_new, next_ids, n_next, tail=tail),)


# ----------------------------------------------------------------- measured on one sequence
@functools.partial(jax.jit, static_argnames=("tail",))
def _chunk(params, state, ids, floor, tail):
    B, S = ids.shape
    n = jnp.full((B,), S, jnp.int32)
    return extend(params, state, ids, n, decoder_swa_bounded_replay=tail is not None, tail=tail,
                  all_logits=True, row_floor=jnp.full((B,), floor, jnp.int32))


@jax.jit
def _decode(params, state, ids):
    logits, state, _ = transformer_v41.forward_chunk(params, state, ids,
                                                     jnp.ones((ids.shape[0],), jnp.int32))
    return logits[0], state


def run_sequence(params, state: V41DecodeState, tokens, start: int, *, chunk: int,
                 tail: int | None, decode_from: int | None = None, row_floor: int = 0):
    """Feeds tokens[start:] to a batch-1 state at length `start`: positions below decode_from
    (default: all) as extends of `chunk` tokens (decoder bounded replay with `tail` rows, None:
    off), the rest as decode steps (every layer, every row). Returns (float32 logits
    [len(tokens) - start, V] of those positions, NaN where the tail skipped a row; new state)."""
    tokens = np.asarray(tokens, np.int32)
    end = len(tokens)
    decode_from = end if decode_from is None else decode_from
    if not start <= decode_from <= end:
        raise ValueError(f"decode_from={decode_from} must lie in [{start}, {end}]")
    out = np.full((end - start, params.config.vocab_size), np.nan, np.float32)
    for off in range(start, decode_from, chunk):
        ids = tokens[off:min(off + chunk, decode_from)]
        lg, state = _chunk(params, state, jnp.asarray(ids[None]), jnp.int32(row_floor), tail)
        lg = np.asarray(lg[0])
        hi = off + len(ids) - start
        out[hi - lg.shape[0]:hi] = lg
    for t in range(decode_from, end):
        lg, state = _decode(params, state, jnp.asarray(tokens[None, t:t + 1]))
        out[t - start] = np.asarray(lg)
    return out, state


def _capacity(n: int, max_len: int | None) -> int:
    return max_len or max(64, 1 << (n - 1).bit_length())


def prefill_logits(params, tokens, *, tail: int | None, chunk: int = 64,
                   decode_from: int | None = None, max_len: int | None = None) -> np.ndarray:
    """float32 [len(tokens), V]: a fresh prefill of tokens[:decode_from] in chunks (decoder
    bounded replay with `tail` rows; None: exact), then teacher-forced decode steps."""
    cfg = params.config
    state = init_v41_state(cfg, 1, _capacity(len(tokens), max_len), dtype=params.dtype)
    return run_sequence(params, state, tokens, 0, chunk=chunk, tail=tail,
                        decode_from=decode_from)[0]


def replay_logits(params, tokens, hit: int, replay: int | None, *, tail: int | None = None,
                  chunk: int = 64, decode_from: int | None = None,
                  max_len: int | None = None) -> np.ndarray:
    """float32 [len(tokens) - hit, V]: the logits at positions hit .. end-1 when the state at
    `hit` is rebuilt from a cached prefix: the latents / index keys of tokens[:hit] (written
    by a prefill with the same `tail`) + a replay of tokens hit-R .. hit-1 (row writes below
    hit suppressed), then the rest (extends below decode_from, decode steps after).
    replay=None: exact (a full prefill from position 0, every layer on every row)."""
    cfg = params.config
    tokens = list(tokens)
    if not 0 < hit < len(tokens):
        raise ValueError(f"hit={hit} must be inside the sequence (length {len(tokens)})")
    cap = _capacity(len(tokens), max_len)
    if replay is None:
        exact, _ = run_sequence(params, init_v41_state(cfg, 1, cap, dtype=params.dtype), tokens,
                                0, chunk=chunk, tail=None, decode_from=decode_from)
        return exact[hit:]
    if replay < 1:
        raise ValueError(f"replay={replay} must be >= 1 (or None: exact)")
    _, cached = run_sequence(params, init_v41_state(cfg, 1, cap, dtype=params.dtype),
                             tokens[:hit], 0, chunk=chunk, tail=tail)
    begin = max(0, hit - replay)
    fresh = init_v41_state(cfg, 1, cap, dtype=params.dtype)
    layers = fresh.layers.map_blocks(
        lambda scanned, layer, old: {k: (old[k] if k in ("rows", "keys") else v)
                                     for k, v in layer.items()}, cached.layers)
    state = V41DecodeState(layers, fresh.token_ring, jnp.full((1,), begin, jnp.int32),
                           fresh.max_len, fresh.window_slots)
    approx, _ = run_sequence(params, state, tokens, begin, chunk=chunk, tail=tail,
                             decode_from=decode_from, row_floor=hit)
    return approx[hit - begin:]


def replay_divergence(params, tokens, hit: int, replay: int, *, tail: int | None = None,
                      chunk: int = 64, decode_from: int | None = None,
                      max_len: int | None = None) -> dict:
    """Logit divergence of a V4.1 prefix replay (and / or decoder bounded replay, `tail`) vs
    the exact prefill for one sequence (`engine.replay.replay_divergence`'s fields: max_abs,
    first_abs, last_abs, per_position, top1_agreement, logit_scale; positions whose row the
    tail skipped are left out)."""
    exact = replay_logits(params, tokens, hit, None, chunk=chunk, decode_from=decode_from,
                          max_len=max_len)
    approx = replay_logits(params, tokens, hit, replay, tail=tail, chunk=chunk,
                           decode_from=decode_from, max_len=max_len)
    ok = ~np.isnan(approx).any(-1)
    per_pos = np.where(ok, np.abs(approx - exact).max(-1, initial=0.0, where=ok[:, None]),
                       np.nan)
    agree = approx.argmax(-1) == exact.argmax(-1)
    return dict(hit=hit, replay=replay, tail=tail, max_abs=float(np.nanmax(per_pos)),
                first_abs=float(per_pos[0]), last_abs=float(per_pos[-1]),
                per_position=per_pos.tolist(), top1_agreement=float(agree[ok].mean()),
                logit_scale=float(np.abs(exact).max()))
