"""The engine's jitted sub-step: one forward of a sub-batch of slots against the paged state.

An engine step is a prefill sub-batch `[Pb, chunk]` and a decode sub-batch `[Db, 1]`, each one
call of `substep` (two static shapes per step; Pb, Db come from a few power-of-two buckets, so
compilation is bounded). Each call:

1. gathers its rows' per-slot rings and, through the block table, their compressed rows from
   the pools into the contiguous `DecodeState` layout `model/cached.py` works on (one code path
   for generate and the engine);
2. runs `transformer.forward_chunk` (prefix-cache replay: `row_floor` keeps the shared rows);
3. samples with `sample_rows` (separable: speculative decoding and grammar masks plug in here);
4. scatters back the per-slot rings and only the pages the chunk wrote (positions
   start .. start + n_new - 1; never a shared page below row_floor, never the null page), and
   the sampled token into `last_token` (a decode row's next input, read on device).

Rings and pools are `LayerStack`s in the model's layer grouping: gathers and scatters work on
the stacked arrays of a scanned group directly (slot / page axis 1), never per layer.

The whole PagedState is donated. Padding rows have slot = max_batch (gathers clip, scatters
drop) and n_new = 0.

Packed host inputs: meta int32 [B, 7] = (slot, start, n_new, row_floor, fresh, top_k, seed
bits), fparams f32 [B, 3] = (temperature, top_p, min_p), block_table int32 [B, max_pages]
(and the prefill tokens). The engine sends them as ONE int32 buffer (`substep_packed`: one
host -> device transfer per call, one device -> host transfer for tokens + logprobs). fresh = 1 resets the slot's window ring (a new request in a
reused slot: stale positions must not look valid); the compressor ring is only read for
positions >= start (or for rows below row_floor, which are dropped), so it needs no reset.

On a mesh (the engine runs under `jax.set_mesh`): the slot and page axes of the PagedState are
split over the batch shards dp x ep and a sub-batch's row block i belongs to shard i;
`gather_state`, `scatter_state`, `take_slots` and `put_slots` run per shard
(`shardings.mesh.per_batch_shard`, slot ids made shard-local, block tables shard-local), so
no ring or pool ever leaves its shard; without a mesh they are the plain functions.

DeepSeek-V4.1: the gathered state is a `V41DecodeState` (rings, the kv sources' `rows` /
`keys` from the pools, the slot's token ring, reset to the pad id where fresh > 0 so a replay
start reads no stale n-gram history); with `tail` (decoder SWA bounded replay, static) prefill
sub-steps run `model.replay_v41.extend` instead of `forward_chunk` (decode steps never do).

Cost note: the gather materialises each row's whole block table of rows (max_len // m per
layer) every call; a paged attention kernel reading the pools in place would avoid that copy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_fn.engine.paged_state import POOL_KEYS, PagedState, shard_axes
from deepinfer_fn.engine.scheduler import META_COLUMNS, PACK_HEAD  # noqa: F401 (packed layout)
from deepinfer_fn.model import replay_v41, transformer
from deepinfer_fn.program_cache import program
from deepinfer_fn.sampling import SamplingParams, sample
from deepinfer_fn.state import DecodeState, V41DecodeState
from deepinfer_fn.structured import unpack_bitmask
# Module import (attributes read at call time): shardings/__init__ imports deepinfer_fn.
from shardings import mesh as mesh_rules



def sample_rows(logits, sampling: SamplingParams, positions):
    """(tokens int32 [B], logprobs f32 [B]) for the logits of each row's last token.

    positions: the absolute position each sampled token will take (= tokens processed so
    far), so the counter-based keys equal generate()'s (sampling.request_key)."""
    return sample(logits, sampling, positions)


def _gather_slots(slots, slot):
    """Per-slot rings of the rows `slot` [B] (slot axis 1 on stacked leaves)."""
    return slots.map_blocks(lambda scanned, layer: {
        k: jnp.take(v, slot, axis=int(scanned), mode="clip") for k, v in layer.items()})


def _scatter_slots(slots, new_layers, slot):
    def one(scanned, layer, new):
        at = (lambda v: v.at[:, slot]) if scanned else (lambda v: v.at[slot])
        return {k: at(v).set(new[k], mode="drop") for k, v in layer.items()}
    return slots.map_blocks(one, new_layers)


def _gather_rows(pools, block_table):
    """pool [(R,) P, rpp, d] -> contiguous rows [(R,) B, max_pages * rpp, d] per layer."""
    B = block_table.shape[0]

    def one(scanned, pool):
        if scanned:
            return {k: v[:, block_table].reshape(v.shape[0], B, -1, v.shape[-1])
                    for k, v in pool.items()}
        return {k: v[block_table].reshape(B, -1, v.shape[-1]) for k, v in pool.items()}
    return pools.map_blocks(one)


def _scatter_rows(pools, new_layers, block_table, start, n_new, row_floor, page_size, S):
    """Writes back the pages positions [start, start + n_new) touched, except shared pages
    (below row_floor) and the null page (stacked pools: every layer of the group)."""
    B, max_pages = block_table.shape
    n_touch = min(max_pages, (S - 1) // page_size + 2)
    page_idx = start[:, None] // page_size + jnp.arange(n_touch)[None]          # [B, n_touch]
    touched = ((page_idx < max_pages) & (page_idx * page_size < (start + n_new)[:, None])
               & (page_idx >= (row_floor // page_size)[:, None]) & (n_new > 0)[:, None])
    safe_idx = jnp.clip(page_idx, 0, max_pages - 1)
    page_id = jnp.take_along_axis(block_table, safe_idx, axis=1)

    def one(scanned, pool, new):
        upd = {}
        for k, v in pool.items():
            num_pages, rpp, d = v.shape[-3:]
            target = jnp.where(touched & (page_id > 0), page_id, num_pages).reshape(-1)
            if scanned:
                R = v.shape[0]
                rows = new[k].reshape(R, B, max_pages, rpp, d)
                vals = jnp.take_along_axis(rows, safe_idx[None, :, :, None, None], axis=2)
                upd[k] = v.at[:, target].set(vals.reshape(R, -1, rpp, d), mode="drop")
            else:
                rows = new[k].reshape(B, max_pages, rpp, d)
                vals = jnp.take_along_axis(rows, safe_idx[:, :, None, None], axis=1)
                upd[k] = v.at[target].set(vals.reshape(-1, rpp, d), mode="drop")
        return upd
    return pools.map_blocks(one, new_layers)


def unpack_sampling(meta, fparams) -> SamplingParams:
    return SamplingParams(temperature=fparams[:, 0], top_k=meta[:, 5], top_p=fparams[:, 1],
                          min_p=fparams[:, 2],
                          seed=jax.lax.bitcast_convert_type(meta[:, 6], jnp.uint32))


def local_slots(slot, shard, slots_per_shard: int):
    """Global slot ids -> the ids within batch shard `shard` (0 without a mesh: unchanged).
    Rows of another shard's slots never reach a shard; padding (slot = max_batch) stays out
    of range."""
    if isinstance(shard, int) and shard == 0:
        return slot
    return slot - shard * slots_per_shard


def take_slots(tree, slot):
    """Rows `slot` [B] of per-slot arrays (slot axis leading: `last_token`, `spec`) ->
    leaves [B, ...]; padding slots clip. On a mesh each batch shard reads its own slots."""
    def local(shard, tree, slot):
        s = local_slots(slot, shard, jax.tree.leaves(tree)[0].shape[0])
        return jax.tree.map(lambda x: jnp.take(x, s, axis=0, mode="clip"), tree)
    if not jax.tree.leaves(tree):
        return tree
    return mesh_rules.per_batch_shard(local, (tree, slot), (0, 0), 0)


def put_slots(tree, slot, new):
    """Writes rows new [B, ...] into per-slot arrays at `slot` [B] (padding slots dropped;
    shard-local on a mesh)."""
    def local(shard, tree, slot, new):
        s = local_slots(slot, shard, jax.tree.leaves(tree)[0].shape[0])
        return jax.tree.map(lambda x, v: x.at[s].set(v.astype(x.dtype), mode="drop"), tree, new)
    if not jax.tree.leaves(tree):
        return tree
    return mesh_rules.per_batch_shard(local, (tree, slot, new), (0, 0, 0), 0)


def _decode_axes(layers, pools=None):
    """A DecodeState layer stack of batch axes (1 on scanned groups), keys of both stacks."""
    others = () if pools is None else (pools,)
    return layers.map_blocks(lambda scanned, *trees: {k: int(scanned) for t in trees for k in t},
                             *others)


def _fresh_tokens(ring, fresh, pad_id: int):
    """A V4.1 token ring [B, R_t] with the rows of fresh slots reset to the pad id (a stale
    history must not reach Engram's n-grams at a replay start)."""
    return jnp.where(fresh[:, None] > 0, jnp.int32(pad_id), ring)


def gather_state(state: PagedState, slot, start, fresh, block_table,
                 pad_id: int | None = None):
    """The contiguous `DecodeState` (V4.1: `V41DecodeState`, its token ring by slot) of a
    sub-batch's rows (slot [B], lengths = start [B]): their per-slot rings (window ring and
    V4.1 token ring emptied where fresh > 0) and, through block_table, their compressed rows.
    On a mesh: per batch shard, from its own slots and pool (row block i of the sub-batch =
    shard i's rows, block_table of shard-local page ids). pad_id: the V4.1 config's
    `engram_pad_token_id` (a fresh slot's token ring)."""
    v41 = state.token_ring is not None
    assert not v41 or pad_id is not None, "gather_state of a V4.1 state needs pad_id"

    def local(shard, state, slot, start, fresh, block_table):
        slot = local_slots(slot, shard, state.max_batch)

        def one(scanned, sl, rows):
            sl = dict(sl)
            sl["window_pos"] = jnp.where(fresh[:, None] > 0, -1, sl["window_pos"])
            sl.update(rows)
            return sl
        layers = _gather_slots(state.slots, slot).map_blocks(
            one, _gather_rows(state.pools, block_table))
        if v41:
            ring = jnp.take(state.token_ring, slot, axis=0, mode="clip")
            return V41DecodeState(layers, _fresh_tokens(ring, fresh, pad_id), start,
                                  state.max_len, state.window_slots)
        return DecodeState(layers, start, state.max_len, state.window_slots)
    axes = _decode_axes(state.slots, state.pools)
    out_axes = (V41DecodeState(axes, 0, 0, state.max_len, state.window_slots) if v41 else
                DecodeState(axes, 0, state.max_len, state.window_slots))
    return mesh_rules.per_batch_shard(local, (state, slot, start, fresh, block_table),
                                      (shard_axes(state), 0, 0, 0, 0), out_axes)


def scatter_state(state: PagedState, new, slot, block_table, start, n_new,
                  row_floor, S: int) -> PagedState:
    """Writes a sub-batch's new `DecodeState` (V4.1: `V41DecodeState`) back: per-slot rings
    (and the V4.1 token ring) by slot, and the pages that positions [start, start + n_new)
    touched (S: the chunk width, bounds the pages). On a mesh: per batch shard, into its own
    slots and pool (as `gather_state`)."""
    v41 = state.token_ring is not None

    def local(shard, state, new, slot, block_table, start, n_new, row_floor):
        slot = local_slots(slot, shard, state.max_batch)
        new_slots = new.layers.map_blocks(
            lambda scanned, layer: {k: v for k, v in layer.items() if k not in POOL_KEYS})
        extra = {}
        if v41:
            extra["token_ring"] = state.token_ring.at[slot].set(new.token_ring, mode="drop")
        return dataclasses.replace(
            state, slots=_scatter_slots(state.slots, new_slots, slot),
            pools=_scatter_rows(state.pools, new.layers, block_table, start, n_new, row_floor,
                                state.page_size, S), **extra)
    axes = shard_axes(state)
    new_axes = _decode_axes(new.layers)
    new_axes = (V41DecodeState(new_axes, 0, 0, new.max_len, new.window_slots) if v41 else
                DecodeState(new_axes, 0, new.max_len, new.window_slots))
    return mesh_rules.per_batch_shard(
        local, (state, new, slot, block_table, start, n_new, row_floor),
        (axes, new_axes, 0, 0, 0, 0, 0), axes)


def _forward(params, state: PagedState, meta, block_table, tokens, tail=None):
    """The forward half of `_substep`: (state with rings and pages written but `last_token`
    untouched, logits f32 [B, V] of each row's last token). tail (V4.1 prefill only): decoder
    SWA bounded replay with that many tail rows (`model.replay_v41.extend`); None: every
    layer on every row."""
    slot, start, n_new, row_floor, fresh = (meta[:, i] for i in range(5))
    if tokens is None:
        tokens = take_slots(state.last_token, slot)[:, None]
        tail = None                         # decode steps run every layer on every row
    S = tokens.shape[1]
    dstate = gather_state(state, slot, start, fresh, block_table,
                          pad_id=params.config.engram_pad_token_id)
    if tail is not None:
        logits, new = replay_v41.extend(params, dstate, tokens, n_new,
                                        decoder_swa_bounded_replay=True, tail=tail,
                                        row_floor=row_floor)
    else:
        logits, new, _ = transformer.forward_chunk(params, dstate, tokens, n_new,
                                                   row_floor=row_floor)
    state = scatter_state(state, new, slot, block_table, start, n_new, row_floor, S)
    return state, logits


def _sample_write(state: PagedState, logits, meta, fparams, allowed=None):
    """The sampling half of `_substep`: samples each row's next token (under `allowed` bool
    [B, V] when given) and writes it into `last_token`. Returns (state, sampled, logprobs)."""
    slot, start, n_new = meta[:, 0], meta[:, 1], meta[:, 2]
    if allowed is None:
        sampled, logp = sample_rows(logits, unpack_sampling(meta, fparams), start + n_new)
    else:
        sampled, logp = sample(logits, unpack_sampling(meta, fparams), start + n_new, allowed)
    state = dataclasses.replace(state, last_token=put_slots(state.last_token, slot, sampled))
    return state, sampled, logp


def _substep(params, state: PagedState, meta, fparams, block_table, tokens, return_logits,
             tail=None):
    """The body of `substep` (shared by `substep` and `substep_packed`)."""
    state, logits = _forward(params, state, meta, block_table, tokens, tail)
    state, sampled, logp = _sample_write(state, logits, meta, fparams)
    if return_logits:
        return state, sampled, logp, logits
    return state, sampled, logp


@program(static_argnames=("return_logits", "tail"), donate_argnums=(1,))
def substep(params, state: PagedState, meta, fparams, block_table, tokens=None, *,
            return_logits: bool = False, tail: int | None = None):
    """One sub-batch. tokens int32 [B, S] (prefill rows, right-padded past n_new) or None
    (decode: S = 1, each row's input is its slot's `last_token`). tail: V4.1 decoder SWA
    bounded replay of prefill rows (`_forward`).

    Returns (state, sampled tokens int32 [B], logprobs f32 [B]) (+ logits f32 [B, V])."""
    return _substep(params, state, meta, fparams, block_table, tokens, return_logits, tail)


def unpack(packed, max_pages: int):
    """packed int32 [B, PACK_HEAD + max_pages + S] -> (meta int32 [B, 7], fparams f32 [B, 3],
    block_table int32 [B, max_pages], tokens int32 [B, S] or None when S = 0). Works on numpy
    and jax arrays."""
    meta = packed[:, :7]
    fbits = packed[:, 7:10]
    if isinstance(packed, np.ndarray):
        fparams = np.ascontiguousarray(fbits).view(np.float32)
    else:
        fparams = jax.lax.bitcast_convert_type(fbits, jnp.float32)
    bt = packed[:, PACK_HEAD:PACK_HEAD + max_pages]
    toks = packed[:, PACK_HEAD + max_pages:]
    return meta, fparams, bt, (toks if toks.shape[1] else None)


@program(static_argnames=("tail",), donate_argnums=(1,))
def substep_packed(params, state: PagedState, packed, *, tail: int | None = None):
    """`substep` on one packed host buffer (one host -> device transfer per call) returning one
    buffer (one device -> host transfer): packed int32 [B, PACK_HEAD + max_pages + S] (S = 0:
    decode) as `unpack` reads it; tail as `substep`. Returns (state, out int32 [B, 2] =
    (sampled token, logprob f32 bits))."""
    meta, fparams, bt, toks = unpack(packed, state.max_pages)
    state, sampled, logp = _substep(params, state, meta, fparams, bt, toks, False, tail)
    out = jnp.stack([sampled, jax.lax.bitcast_convert_type(logp, jnp.int32)], axis=1)
    return state, out


def fixed_trip_counts(most: int) -> tuple[int, ...]:
    """The loop lengths of `decode_steps_packed(fixed_trips=True)` an engine compiles: powers
    of two below `most`, then `most`."""
    assert most >= 1, most
    return tuple(sorted({1 << i for i in range(most.bit_length()) if 1 << i < most} | {most}))


@program(static_argnames=("steps", "fixed_trips"), donate_argnums=(1,))
def decode_steps_packed(params, state: PagedState, packed, *, steps: int,
                        fixed_trips: bool = False):
    """Up to `steps` decode steps of a sub-batch in ONE device call: packed as a decode
    `substep_packed` (S = 0) whose n_new column holds each row's step count n_b <= steps. Step
    i feeds every row with n_b > i its previous token at position start + i, exactly as i + 1
    consecutive `substep_packed` calls would (same sampling keys); rows with n_b <= i run with
    n_new = 0 (state unchanged). The rows' state is gathered once before the loop and
    scattered once after it. The loop runs max(n_b) iterations, or with fixed_trips exactly
    `steps` (a loop of known trip count: XLA:GPU issues it without reading a condition on
    the host each iteration). Returns (state, out int32 [B, steps, 2] = (token, logprob f32
    bits) per step; entries past a row's n_b are zero)."""
    meta, fparams, bt, _ = unpack(packed, state.max_pages)
    assert steps >= 1, steps
    slot, start, row_floor, fresh = meta[:, 0], meta[:, 1], meta[:, 3], meta[:, 4]
    n_steps = jnp.minimum(meta[:, 2], steps)
    B = meta.shape[0]
    sampling = unpack_sampling(meta, fparams)
    # the rows' state is gathered once and scattered once: the loop runs on the contiguous copy
    dstate = gather_state(state, slot, start, fresh, bt,
                          pad_id=params.config.engram_pad_token_id)

    def body(i, carry):
        dstate, token, out = carry
        active = i < n_steps
        logits, dstate, _ = transformer.forward_chunk(params, dstate, token[:, None],
                                                      active.astype(jnp.int32),
                                                      row_floor=row_floor)
        sampled, logp = sample_rows(logits, sampling, start + i + 1)
        step_out = jnp.stack([sampled, jax.lax.bitcast_convert_type(logp, jnp.int32)], axis=1)
        step_out = jnp.where(active[:, None], step_out, 0)
        out = jax.lax.dynamic_update_slice(out, step_out[:, None], (0, i, 0))
        return dstate, jnp.where(active, sampled, token), out

    carry = (dstate, take_slots(state.last_token, slot), jnp.zeros((B, steps, 2), jnp.int32))
    trips = steps if fixed_trips else jnp.max(n_steps)
    dstate, token, out = jax.lax.fori_loop(0, trips, body, carry)
    state = scatter_state(state, dstate, slot, bt, start, n_steps, row_floor, steps)
    return dataclasses.replace(state, last_token=put_slots(state.last_token, slot, token)), out


# --- constrained sub-batches (structured output): forward and masked sampling, split ----------


@program(static_argnames=("tail",), donate_argnums=(1,))
def forward_packed(params, state: PagedState, packed, *, tail: int | None = None):
    """The forward half of `substep_packed` (a sub-batch with constrained rows): returns (state,
    logits f32 [B, V]); `last_token` is written by the `sample_packed` call that follows, once
    the host has packed the masks (it computes them while this forward runs)."""
    meta, _, bt, toks = unpack(packed, state.max_pages)
    return _forward(params, state, meta, bt, toks, tail)


@program(donate_argnums=(0,))
def sample_packed(state: PagedState, logits, head, masks):
    """The sampling half (head int32 [B, PACK_HEAD]: the first columns of the packed buffer):
    masks uint32 [B, ceil(V/32)] (packed allowed-token bits; all-ones for
    free and padding rows) applied inside the sampler. Returns (state, out int32 [B, 2]) as
    `substep_packed`."""
    meta, fparams, _, _ = unpack(head, 0)
    allowed = unpack_bitmask(masks, logits.shape[-1])
    state, sampled, logp = _sample_write(state, logits, meta, fparams, allowed)
    out = jnp.stack([sampled, jax.lax.bitcast_convert_type(logp, jnp.int32)], axis=1)
    return state, out
