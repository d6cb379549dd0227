"""The DeepSeek-V4.1 backbone over a whole sequence (docs/MODEL.md §V2.0).

    X = broadcast(Embed[ids]) to n streams;  p = e_0
    for l in layers:
        if l is an Engram layer: X = Engram_l(X, hash ids)            # p unchanged
        X, p = lagged sublayer(hc_attn, attn_norm, Attention_l)       # model.lagged_mhc
        X, p = lagged sublayer(hc_ffn, ffn_norm, MoE_l)
    logits = head(norm(sum_j p_j X_j))                                # no hc_head

Attention reads and writes the shared latents / selections of `model.attention_v41`; they
travel through the layer stack with the streams, so scanned layer groups (`layer_groups.py`)
run as one `lax.scan` like V4. Engram's hash ids are computed once for the sequence (fresh
request: pad history) from a token map (`default_token_map`).

Engram tables as arrays in the params (on the device, or row-sharded over a mesh) are read
with `jnp.take` in each Engram layer. Tables in a host store (`engram_store.HostTables` in the
params, `load_params(engram_store="host")`): `engram_inputs` gathers every Engram layer's
rows once per call, right after the ids are hashed, through one host callback, and the
layers read those rows (`EngramRows`). The device waits for that gather: the ids exist only
once the tokens are on the device. Where the host knows the tokens ahead (prompt chunks,
verify blocks), `host_row_ids` + `HostEngramStore.submit` gather the next chunk while the
current one runs and `forward_chunk(engram_rows=store.take())` skips the callback; plain
decode learns its ids only when the previous token is sampled, so it takes the callback.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_fn.config import SCORE_MOE, ModelConfig
from deepinfer_fn.layer_groups import LayerStack, as_stack, layer_groups
from deepinfer_fn.model import engram
from deepinfer_fn.model.attention_v41 import attention_sequence, empty_shared
from deepinfer_fn.model.cached_v41 import attention_chunk, chunk_positions, ring_read, ring_write
from deepinfer_fn.model.common import rms_norm
from deepinfer_fn.model.engram_store import HOST_TABLES, host_rows, host_store_of
from deepinfer_fn.model.lagged_mhc import (final_collapse, fused_sublayer, initial_pending,
                                           lagged_sublayer)
from deepinfer_fn.model.moe import moe_layer
from deepinfer_fn.state import V41DecodeState


@functools.lru_cache(maxsize=8)
def _identity_map(n: int) -> np.ndarray:
    out = np.arange(n, dtype=np.int32)
    out.setflags(write=False)
    return out


def default_token_map(cfg: ModelConfig) -> np.ndarray:
    """The Engram token map for cfg: the identity when the compressed vocabulary is the whole
    vocabulary (test configs), else the normalising map of the real V4 tokenizer (checked
    against engram_compressed_vocab_size)."""
    if cfg.engram_compressed_vocab_size == cfg.vocab_size:
        return _identity_map(cfg.vocab_size)
    token_map = engram.load_token_map()
    engram.check_token_map(token_map, engram.HashConstants.from_config(cfg), cfg.vocab_size)
    return token_map


def engram_row_ids(cfg: ModelConfig, token_ids: jax.Array, token_map=None) -> jax.Array:
    """int32 [B, T, L_e, C]: every Engram layer's table rows for a sequence from position 0."""
    consts = engram.HashConstants.from_config(cfg)
    token_map = default_token_map(cfg) if token_map is None else token_map
    history = engram.initial_history(token_ids.shape[0], consts)
    return engram.hash_ids(token_ids, history, jnp.asarray(token_map, jnp.int32), consts)


def host_row_ids(cfg: ModelConfig, token_ids, history, token_map=None) -> np.ndarray:
    """numpy int32 [B, S, L_e, C]: the Engram rows a chunk reads, computed on the host (for a
    prefetch: `HostEngramStore.submit`). token_ids [B, S] as passed to `forward_chunk`
    (clipped to the vocabulary the same way); history [B, n-1] the raw ids before the chunk,
    oldest first (pad_id before the sequence start: `np.full((B, 3), cfg.engram_pad_token_id)`
    for a fresh request). Equal to the ids `forward_chunk` hashes on the device."""
    consts = engram.HashConstants.from_config(cfg)
    token_map = default_token_map(cfg) if token_map is None else token_map
    ids = np.clip(np.asarray(token_ids), 0, cfg.vocab_size - 1)
    history = np.asarray(history)
    if ids.ndim != 2 or history.shape != (ids.shape[0], consts.history):
        raise ValueError(f"host_row_ids: token_ids must be [B, S] and history [B, "
                         f"{consts.history}], got {ids.shape} and {history.shape}")
    return engram.hash_ids_host(ids, history, np.asarray(token_map), consts)


class EngramRows(NamedTuple):
    """Every Engram layer's table rows of a call, gathered before the layers: codes uint8
    [B, T, L_e, C, W], scales uint8 [B, T, L_e, C, W/32] (a store's gather layout)."""

    codes: jax.Array
    scales: jax.Array


def engram_inputs(params, row_ids: jax.Array | None, rows=None):
    """What the Engram layers read: row_ids int32 [B, T, L_e, C] when the tables are arrays
    in the params; `EngramRows` of `rows` ((codes, scales) gathered ahead, e.g. by a store's
    `take`) when given; else, for tables in a host store, the rows gathered now through one
    host callback (`engram_store.host_rows`)."""
    if row_ids is None:
        if rows is not None:
            raise ValueError("engram_rows given, but the model has no Engram layers")
        return None
    if rows is not None:
        codes, scales = rows
        W, nb = params.config.engram_head_dim, -(-params.config.engram_head_dim // 32)
        if (tuple(codes.shape) != tuple(row_ids.shape) + (W,)
                or tuple(scales.shape) != tuple(row_ids.shape) + (nb,)):
            raise ValueError(f"engram_rows must be (codes {tuple(row_ids.shape) + (W,)}, scales "
                             f"{tuple(row_ids.shape) + (nb,)}) for these tokens, got "
                             f"{tuple(codes.shape)} and {tuple(scales.shape)}")
        return EngramRows(jnp.asarray(codes), jnp.asarray(scales))
    store = host_store_of(params["layers"])
    if store is None:
        return row_ids
    return EngramRows(*host_rows(store, row_ids))


def engram_update(w: dict, streams: jax.Array, row_ids: jax.Array, token_ids: jax.Array,
                  cfg: ModelConfig, rows=None) -> jax.Array:
    """One Engram layer on the residual streams [B, T, n, D]; row_ids int32 [B, T, C] (this
    layer's columns). Tables: FP8 bytes + UE8M0 scales, or a float array of dequantised rows
    (test configs); rows: this layer's gathered (codes uint8 [B, T, C, W], scales uint8
    [B, T, C, W/32]) instead (tables in a host store; row_ids unused). Image-token rows are
    left unchanged."""
    skip = token_ids == cfg.image_token_id if cfg.image_token_id >= 0 else None
    if rows is not None:
        codes, scales = rows
        e = engram.dequantize_rows(codes, scales, w["wkv"].dtype)
        e = e.reshape(e.shape[:-2] + (e.shape[-2] * e.shape[-1],))
        return engram.gate(streams, e, w["wkv"], w["q_weight"], w["k_weight"],
                           eps=cfg.rms_norm_eps, skip=skip)
    if HOST_TABLES in w:
        raise ValueError("engram_update: this layer's tables are in a host store; pass the "
                         "gathered rows (transformer_v41.engram_inputs)")
    table = w["table"]
    if jnp.issubdtype(table.dtype, jnp.floating):
        e = jnp.take(table, row_ids, axis=0).astype(w["wkv"].dtype)
        e = e.reshape(row_ids.shape[:-1] + (-1,))
        return engram.gate(streams, e, w["wkv"], w["q_weight"], w["k_weight"],
                           eps=cfg.rms_norm_eps, skip=skip)
    return engram.engram(w, streams, row_ids, eps=cfg.rms_norm_eps, skip=skip)


def routed_ffn(fp: dict, token_ids: jax.Array, cfg: ModelConfig) -> dict:
    """The MoE params of a layer for these tokens: rows whose id is image_token_id select
    experts with `gate_bias_vl` instead of `gate_bias` (a per-token bias [B*T, E])."""
    if cfg.image_token_id < 0 or "gate_bias_vl" not in fp:
        return fp
    image = (token_ids.reshape(-1) == cfg.image_token_id)[:, None]
    return {**fp, "gate_bias": jnp.where(image, fp["gate_bias_vl"], fp["gate_bias"])}


def embed(params, token_ids: jax.Array) -> jax.Array:
    """Embedding rows broadcast to the n mHC streams: [B, T] -> [B, T, n, D]."""
    e = params["embed"][token_ids]
    return jnp.broadcast_to(e[:, :, None, :], (*e.shape[:2], params.config.hc_mult, e.shape[-1]))


def maybe_engram(lp, streams, layer_id, kind: str, token_ids, row_ids, cfg: ModelConfig):
    """Engram before the layer if it is an Engram layer (layer_id: int or traced int32).
    row_ids: `engram_inputs` (ids int32 [B, T, L_e, C] or `EngramRows`); plain ids with the
    tables in a host store gather every layer's rows here (a callback per Engram layer)."""
    if "engram" not in kind.split("+")[1:]:
        return streams
    ids = jnp.asarray(cfg.engram_layer_ids, jnp.int32)
    i = jnp.searchsorted(ids, jnp.asarray(layer_id, jnp.int32))
    w = lp["engram"]
    if not isinstance(row_ids, EngramRows) and HOST_TABLES in w:
        row_ids = EngramRows(*host_rows(w[HOST_TABLES].store, row_ids))   # one gather per layer
    if isinstance(row_ids, EngramRows):
        rows = tuple(jnp.take(a, i, axis=2) for a in row_ids)
        return engram_update(w, streams, None, token_ids, cfg, rows=rows)
    return engram_update(w, streams, jnp.take(row_ids, i, axis=2), token_ids, cfg)


def layer(lp, carry, layer_id, kind: str, token_ids, positions, row_ids, cfg: ModelConfig,
          lagged: bool = True):
    """One V4.1 layer: carry (streams [B,T,n,D], pending [B,T,n] fp32, shared buffers) ->
    the new carry. layer_id: int or traced int32 (selects the Engram columns)."""
    streams, pending, shared = carry
    sub = lagged_sublayer if lagged else fused_sublayer
    streams = maybe_engram(lp, streams, layer_id, kind, token_ids, row_ids, cfg)
    streams, pending, shared = sub(
        lp["hc_attn"], lp["attn_norm"], streams, pending,
        lambda h: attention_sequence(lp["attn"], h, positions, kind, shared, cfg), cfg)
    streams, pending, _ = sub(
        lp["hc_ffn"], lp["ffn_norm"], streams, pending,
        lambda h: (moe_layer(routed_ffn(lp["ffn"], token_ids, cfg), h, token_ids, SCORE_MOE,
                             cfg), None), cfg)
    return streams, pending, shared


def backbone(params, token_ids: jax.Array, token_map=None, *, lagged: bool = True,
             engram_rows=None):
    """Final residual streams [B, T, n, D] and pending weights [B, T, n] (the last FFN's pre)
    of the whole V4.1 stack over token_ids [B, T] from position 0. lagged=False runs V4's
    fused collapse instead (an ablation: not the V4.1 model). engram_rows: as in
    `forward_chunk`."""
    cfg = params.config
    if not cfg.is_v41:
        raise ValueError(f"transformer_v41.backbone needs a V4.1 config, got {cfg.model_type!r}")
    B, T = token_ids.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    row_ids = engram_row_ids(cfg, token_ids, token_map) if cfg.engram_layer_ids else None
    row_ids = engram_inputs(params, row_ids, engram_rows)
    streams = embed(params, token_ids)
    carry = (streams, initial_pending((B, T), cfg.hc_mult),
             empty_shared(cfg, B, T, streams.dtype))
    groups = layer_groups(cfg)
    layers = as_stack(groups, params["layers"])
    args = (token_ids, positions, row_ids, cfg, lagged)
    for g, blk in zip(layers.groups, layers.blocks):
        if not g.scanned:
            (kind, _), = g.kinds
            carry = layer(blk[0], carry, g.start, kind, *args)
            continue

        def body(carry, xs, g=g):
            lps, r = xs
            for j, (kind, _) in enumerate(g.kinds):
                carry = layer(lps[j], carry, g.start + r * g.unit + j, kind, *args)
            return carry, None

        carry, _ = jax.lax.scan(body, carry, (blk, jnp.arange(g.repeats, dtype=jnp.int32)))
    streams, pending, _ = carry
    return streams, pending


def head_logits(params, streams: jax.Array, pending: jax.Array) -> jax.Array:
    """Collapse with the last pre, final norm, untied head: -> float32 logits [B, T, V]."""
    cfg = params.config
    head = params["head"]
    h = rms_norm(final_collapse(streams, pending), params["norm"], cfg.rms_norm_eps)
    return jnp.matmul(h.astype(head.dtype), head, preferred_element_type=jnp.float32,
                      precision=jax.lax.Precision.HIGHEST if head.dtype == jnp.float32 else None)


def logits_and_streams(params, token_ids: jax.Array, token_map=None, *, lagged: bool = True):
    """(float32 logits [B, T, V], final residual streams [B, T, n, D]) of a V4.1 model."""
    streams, pending = backbone(params, token_ids, token_map, lagged=lagged)
    return head_logits(params, streams, pending), streams


def chunk_history(state: V41DecodeState, consts: engram.HashConstants) -> jax.Array:
    """int32 [B, n-1]: the raw ids before each row's chunk, oldest first (pad before the
    sequence start), read from the state's token ring."""
    pos = state.lengths[:, None] + jnp.arange(-consts.history, 0, dtype=jnp.int32)[None]
    ids = ring_read(state.token_ring, jnp.maximum(pos, 0))
    return jnp.where(pos >= 0, ids, consts.pad_id).astype(jnp.int32)


def layer_chunk(lp, ls, carry, layer_id, kind: str, token_ids, row_ids, start, n_new,
                cfg: ModelConfig, row_floor=None, window_floor=None):
    """One V4.1 layer over a chunk against its state ls: carry (streams [B,S,n,D], pending
    [B,S,n], shared buffers) -> (new carry, new layer state). row_floor / window_floor [B]
    (optional): as `cached_v41.attention_chunk`."""
    streams, pending, shared = carry
    streams = maybe_engram(lp, streams, layer_id, kind, token_ids, row_ids, cfg)

    def attend(h):
        out, new_ls, new_shared = attention_chunk(lp["attn"], h, ls, start, n_new, kind, shared,
                                                  cfg, row_floor, window_floor)
        return out, (new_ls, new_shared)

    streams, pending, (new_ls, shared) = lagged_sublayer(
        lp["hc_attn"], lp["attn_norm"], streams, pending, attend, cfg)
    streams, pending, _ = lagged_sublayer(
        lp["hc_ffn"], lp["ffn_norm"], streams, pending,
        lambda h: (moe_layer(routed_ffn(lp["ffn"], token_ids, cfg), h, token_ids, SCORE_MOE,
                             cfg), None), cfg)
    return (streams, pending, shared), {**ls, **new_ls}


def without_engram(kind: str) -> str:
    """A layer kind without its Engram role (the Engram update already applied)."""
    return "+".join(p for p in kind.split("+") if p != "engram")


def check_taps(cfg: ModelConfig, taps, tap: str) -> None:
    """ValueError unless taps are layer ids of cfg and tap is "pre" or "post"."""
    if tap not in ("pre", "post"):
        raise ValueError(f"tap must be 'pre' or 'post', got {tap!r}")
    bad = [i for i in taps if not 0 <= i < cfg.num_hidden_layers]
    if bad:
        raise ValueError(f"tap layer ids {bad} outside [0, {cfg.num_hidden_layers})")


def forward_chunk(params, state: V41DecodeState, token_ids: jax.Array, n_new: jax.Array, *,
                  all_logits: bool = False, token_map=None, row_floor=None,
                  taps: tuple[int, ...] | None = None, tap: str = "pre", engram_rows=None):
    """A chunk against a V4.1 decode state (prefill chunk, decode step or verify chunk).

    token_ids [B, S] int32 (entries past n_new[b] are padding); n_new [B] int32 in [0, S].
    row_floor [B] int32 (optional): kv sources write no latent / index-key row at a position
    below it (prefix-cache replay keeps the shared exact rows, docs/MODEL.md §7); window
    rings, the code-2 kappa / gate ring and the token ring are still written.
    Returns (logits, new state, streams): logits float32 [B, S, V] if all_logits, else those
    of each row's last valid token [B, V]; streams [B, S, n, D] the final residual streams.
    Scanned layer groups run as one `lax.scan` (the shared buffers in the carry, the layer
    states as scan inputs / outputs); the new state has the params' grouping.

    taps (layer ids, the DSpark target features of docs/MODEL.md §V5.2): also return a 4th
    output, features [B, S, len(taps), D], the residual streams averaged over the n copies
    at the tapped layer's input after its Engram update ("pre") or at its output ("post").

    engram_rows (optional): (codes uint8 [B, S, L_e, C, W], scales uint8 [B, S, L_e, C,
    W/32]), the chunk's Engram rows gathered ahead (`host_row_ids` of the same tokens and
    history, `HostEngramStore.submit` / `take`); without it, tables in a host store are
    gathered by one host callback right after the ids are hashed."""
    cfg = params.config
    if not isinstance(state, V41DecodeState):
        raise TypeError(f"forward_chunk: a V4.1 model needs a state.V41DecodeState, got "
                        f"{type(state).__name__}")
    B, S = token_ids.shape
    token_ids = jnp.clip(token_ids, 0, cfg.vocab_size - 1).astype(jnp.int32)
    n_new = n_new.astype(jnp.int32)
    start = state.lengths
    if row_floor is not None:
        row_floor = jnp.broadcast_to(jnp.asarray(row_floor, jnp.int32), (B,))
    row_ids = None
    if cfg.engram_layer_ids:
        consts = engram.HashConstants.from_config(cfg)
        token_map = default_token_map(cfg) if token_map is None else token_map
        row_ids = engram.hash_ids(token_ids, chunk_history(state, consts), jnp.asarray(
            token_map, jnp.int32), consts)
    row_ids = engram_inputs(params, row_ids, engram_rows)
    streams = embed(params, token_ids)
    carry = (streams, initial_pending((B, S), cfg.hc_mult),
             empty_shared(cfg, B, S, streams.dtype, capacity=state.max_len))
    groups = layer_groups(cfg)
    players = as_stack(groups, params["layers"])
    slayers = as_stack(groups, state.layers)
    args = (token_ids, row_ids, start, n_new, cfg)
    if taps is not None:
        check_taps(cfg, taps, tap)
    tap_set, tapped = set(taps or ()), {}

    def run_layer(lp, ls, carry, layer_id, kind, with_tap: bool):
        """layer_chunk, plus the layer's feature [B, S, D] when with_tap (else None)."""
        if not with_tap:
            return layer_chunk(lp, ls, carry, layer_id, kind, *args,
                               row_floor=row_floor) + (None,)
        streams, pending, shared = carry
        streams = maybe_engram(lp, streams, layer_id, kind, token_ids, row_ids, cfg)
        carry, new_ls = layer_chunk(lp, ls, (streams, pending, shared), layer_id,
                                    without_engram(kind), *args, row_floor=row_floor)
        return carry, new_ls, (streams if tap == "pre" else carry[0]).mean(axis=2)

    new_blocks = []
    for g, pblk, sblk in zip(groups, players.blocks, slayers.blocks):
        if not g.scanned:
            (kind, _), = g.kinds
            carry, new_ls, f = run_layer(pblk[0], sblk[0], carry, g.start, kind,
                                         g.start in tap_set)
            if f is not None:
                tapped[g.start] = f
            new_blocks.append((new_ls,))
            continue
        # unit positions j with a tapped layer in this group: their features per repeat
        tap_pos = sorted({g.locate(i)[1] for i in tap_set if g.start <= i < g.stop})

        def body(carry, xs, g=g, tap_pos=tap_pos):
            lps, lss, r = xs
            outs, feats = [], []
            for j, (kind, _) in enumerate(g.kinds):
                carry, new_ls, f = run_layer(lps[j], lss[j], carry, g.start + r * g.unit + j,
                                             kind, j in tap_pos)
                outs.append(new_ls)
                if f is not None:
                    feats.append(f)
            return carry, (tuple(outs), tuple(feats))

        carry, (new_sts, ys) = jax.lax.scan(
            body, carry, (pblk, sblk, jnp.arange(g.repeats, dtype=jnp.int32)))
        for i in tap_set:
            if g.start <= i < g.stop:
                r, j = g.locate(i)
                tapped[i] = ys[tap_pos.index(j)][r]
        new_blocks.append(new_sts)
    streams, pending, _ = carry
    pos, valid = chunk_positions(start, n_new, S)
    tokens = ring_write(state.token_ring, pos, token_ids, valid)
    new_state = V41DecodeState(LayerStack(groups, tuple(new_blocks)), tokens, start + n_new,
                               state.max_len, state.window_slots)
    extra = () if taps is None else (jnp.stack([tapped[i] for i in taps], axis=2),)
    if all_logits:
        return (head_logits(params, streams, pending), new_state, streams) + extra
    last = jnp.clip(n_new - 1, 0, S - 1)
    take = lambda a: jnp.take_along_axis(a, last.reshape((B, 1) + (1,) * (a.ndim - 2)), axis=1)
    return (head_logits(params, take(streams), take(pending))[:, 0], new_state,
            streams) + extra
