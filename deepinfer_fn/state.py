"""Decode state: everything a sequence carries between calls (docs/MODEL.md §3).

Contiguous layout (one slot per batch row). Per layer, a dict of fixed-capacity arrays:

  window_kv   [B, W_slots, d]   rotated KV of the last tokens, ring slot = position % W_slots
  window_pos  [B, W_slots]      absolute position held by each slot (-1 = empty)
  CSA / HCA (ratio m, c = 2 for CSA, 1 for HCA):
  rows        [B, R, d]         compressed rows, row w at index w; R = max_len // m
  raw_kv      [B, R_c, c*d]     compressor ring: raw kappa of the last tokens, slot = position % R_c
  raw_gate    [B, R_c, c*d] f32 their gate + ape
  CSA only:
  index_rows, index_raw_kv, index_raw_gate: the same for the lightning indexer's own
  compressor (dimension d_I).

R_c = c*m + (W_slots - sliding_window): the unfinished window (HCA) or the last finished
window plus the unfinished one (CSA, whose row w pools the A-halves of window w-1), plus the
same slack as the window ring.

`lengths [B]` counts the tokens each row has processed (= next position). Everything else is
addressed by absolute position and derived from it (row count = lengths // m, visible rows,
live ring slots), so rolling a row back over rejected draft tokens is only `lengths` moving
back (docs/MODEL.md §D2.7). Why that is complete, for a verify chunk of at most S = k + 1
tokens (k drafts) at positions L..L+k rolled back to L' = L + g + 1 (g accepted):

* window ring: rejected tokens wrote slots of positions <= L + k <= L' + k - 1. The next
  chunk reads ring entries of positions L' - W + 1 .. L' - 1 (only those < its start: the
  kernel reads the ring before writing it), so the live ones are intact iff
  W_slots >= W + k - 1; stale slots (position >= start) are masked by `window_pos`.
* compressed rows (main and indexer): a row whose window closed inside the rejected tail
  sits at an index the committed queries cannot see (visibility is positional); the next
  chunk that processes the closing token rewrites the row before any query reads it.
* compressor ring: the next chunk pools windows from positions >= (L'//m - 1)*m (CSA) or
  >= (L'//m)*m (HCA), i.e. at most 2m - 1 (m - 1) positions before L'; rejected writes reach
  L' + k - 1, so R_c >= 2m + k - 1 (m + k - 1) keeps them intact, which the R_c above gives
  whenever W_slots >= W + k - 1.
  (The former layout -- a partial-window buffer re-based at every window start plus a CSA
  "overlap" copy of the last finished window -- was overwritten when a window closed inside
  the rejected tail, and the accepted positions of the reopened window were lost.)

So: speculative decoding with k drafts needs `window_slots >= sliding_window + k - 1`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from deepinfer_fn.config import CSA, HCA, ModelConfig
from deepinfer_fn.layer_groups import LayerStack, layer_groups
from deepinfer_fn.errors import ArgumentError
from deepinfer_fn.validate import float_dtype, positive_int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """`layers`: a `LayerStack` in the model's grouping (scanned groups: leaves
    [repeats, B, ...], batch axis 1; `layers[i]` is layer i's dict), or a plain tuple of
    per-layer dicts (drafters' states; `forward_chunk` restacks a tuple)."""

    layers: LayerStack | tuple[dict[str, jax.Array], ...]
    lengths: jax.Array                      # [B] int32
    max_len: int = dataclasses.field(metadata=dict(static=True))
    window_slots: int = dataclasses.field(metadata=dict(static=True))

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]


def layer_state_shapes(cfg: ModelConfig, layer_type: str, batch: int, max_len: int,
                       window_slots: int, dtype) -> dict[str, jax.ShapeDtypeStruct]:
    d = cfg.head_dim
    f32 = jnp.float32
    S = jax.ShapeDtypeStruct
    shapes = {"window_kv": S((batch, window_slots, d), dtype),
              "window_pos": S((batch, window_slots), jnp.int32)}
    if layer_type in (CSA, HCA):
        m = cfg.compress_ratio_of(layer_type)
        c = 2 if layer_type == CSA else 1
        cap = max(max_len // m, 1)
        ring = compressor_ring_slots(cfg, layer_type, window_slots)
        shapes.update(rows=S((batch, cap, d), dtype), raw_kv=S((batch, ring, c * d), dtype),
                      raw_gate=S((batch, ring, c * d), f32))
        if layer_type == CSA:
            dI = cfg.index_head_dim
            shapes.update(index_rows=S((batch, cap, dI), dtype),
                          index_raw_kv=S((batch, ring, 2 * dI), dtype),
                          index_raw_gate=S((batch, ring, 2 * dI), f32))
    return shapes


def compressor_ring_slots(cfg: ModelConfig, layer_type: str, window_slots: int) -> int:
    """R_c: slots of a compressed layer's raw compressor ring (module docstring)."""
    m = cfg.compress_ratio_of(layer_type)
    return (2 if layer_type == CSA else 1) * m + (window_slots - cfg.sliding_window)


def _initial(name: str, shape: jax.ShapeDtypeStruct) -> jax.Array:
    if name == "window_pos":
        return jnp.full(shape.shape, -1, shape.dtype)
    return jnp.zeros(shape.shape, shape.dtype)


def init_state(cfg: ModelConfig, batch: int, max_len: int, *, window_slots: int | None = None,
               dtype=jnp.float32) -> DecodeState:
    """An empty state for `batch` sequences of up to `max_len` tokens.

    window_slots defaults to the sliding window; speculative decoding with draft length k
    needs sliding_window + k - 1 slots so rejected tokens never overwrite live entries (the
    compressor rings get the same slack). V4.1 configs get a `V41DecodeState`
    (`init_v41_state`).
    """
    if cfg.is_v41:
        return init_v41_state(cfg, batch, max_len, window_slots=window_slots, dtype=dtype)
    positive_int("init_state", "batch", batch)
    positive_int("init_state", "max_len", max_len)
    if window_slots is not None:
        positive_int("init_state", "window_slots", window_slots)
    float_dtype("init_state", "dtype", dtype)
    window_slots = window_slots or cfg.sliding_window
    if window_slots < cfg.sliding_window:
        raise ArgumentError(f"window_slots={window_slots} < sliding_window={cfg.sliding_window}")
    if max_len > cfg.max_position_embeddings:
        raise ArgumentError(f"max_len={max_len} > max_position_embeddings={cfg.max_position_embeddings}")
    shapes = state_shapes(cfg, batch, max_len, window_slots, dtype)
    layers = shapes.map_blocks(lambda scanned, tree: {k: _initial(k, v) for k, v in tree.items()})
    return DecodeState(layers, jnp.zeros((batch,), jnp.int32), max_len, window_slots)


def state_shapes(cfg: ModelConfig, batch: int, max_len: int, window_slots: int,
                 dtype) -> LayerStack:
    """The `DecodeState.layers` shapes of `cfg` (stacked per `layer_groups`)."""
    stack = lambda xs: jax.ShapeDtypeStruct((len(xs),) + xs[0].shape, xs[0].dtype)
    return LayerStack.from_layers(
        layer_groups(cfg), [layer_state_shapes(cfg, lt, batch, max_len, window_slots, dtype)
                            for lt in cfg.layer_types], stack=stack)


def state_bytes(cfg: ModelConfig, batch: int, max_len: int, window_slots: int | None = None,
                dtype=jnp.bfloat16) -> int:
    """Bytes of a decode state (for memory planning and the roofline)."""
    window_slots = window_slots or cfg.sliding_window
    total = 0
    if cfg.is_v41:
        for i in range(cfg.num_hidden_layers):
            for s in v41_layer_state_shapes(cfg, i, batch, max_len, window_slots,
                                            dtype).values():
                total += s.size * jnp.dtype(s.dtype).itemsize
        return total + 4 * batch * (1 + token_slots(cfg, window_slots))
    for lt in cfg.layer_types:
        for s in layer_state_shapes(cfg, lt, batch, max_len, window_slots, dtype).values():
            total += s.size * jnp.dtype(s.dtype).itemsize
    return total + 4 * batch


# ------------------------------------------------------------------------------ V4.1 state
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class V41DecodeState:
    """DeepSeek-V4.1 decode state (docs/MODEL.md §V3): per layer (a `LayerStack` in the
    model's grouping, as `DecodeState`; or a tuple of per-layer dicts)

      window_kv [B, W_slots, d], window_pos [B, W_slots]   every layer (ring, as V4)
      rows [B, R, d], keys [B, R, d_I]                      kv sources only: rotated latents
                                                            and index keys, row j at index j;
                                                            R = max_len // code
      pend_kv [B, R_p, d], pend_gate [B, R_p, d] f32       code-2 sources: ring of the raw
                                                            kappa / gate of recent tokens (the
                                                            partner of a pair that closes in
                                                            the next chunk), slot = pos % R_p

    plus `token_ring [B, R_t]` int32 (recent raw ids, slot = position % R_t: Engram's n-gram
    context) and `lengths [B]`. Non-source layers hold no compressed rows. Selections,
    candidate blocks and the mHC pending weights are recomputed per token, not state.

    As in V4, everything is addressed by absolute position, so rolling back over rejected
    tokens is only `lengths` moving back: with W_slots = W + k - 1 for k drafts, the slack
    k - 1 of R_p = 2 + slack and R_t = n + slack keeps the entries the next chunk reads
    (position L' - 1, resp. L' - n + 1 .. L' - 1) out of reach of the rejected writes."""

    layers: LayerStack | tuple[dict[str, jax.Array], ...]
    token_ring: jax.Array                   # [B, R_t] int32
    lengths: jax.Array                      # [B] int32
    max_len: int = dataclasses.field(metadata=dict(static=True))
    window_slots: int = dataclasses.field(metadata=dict(static=True))

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]


def v41_layer_state_shapes(cfg: ModelConfig, layer: int, batch: int, max_len: int,
                           window_slots: int, dtype) -> dict[str, jax.ShapeDtypeStruct]:
    """The state arrays of V4.1 layer `layer` (`V41DecodeState`)."""
    d, dI = cfg.head_dim, cfg.index_head_dim
    S = jax.ShapeDtypeStruct
    shapes = {"window_kv": S((batch, window_slots, d), dtype),
              "window_pos": S((batch, window_slots), jnp.int32)}
    if layer in cfg.kv_source_layer_ids:
        code = cfg.compress_ratio(layer)
        cap = max(max_len // code, 1)
        shapes.update(rows=S((batch, cap, d), dtype), keys=S((batch, cap, dI), dtype))
        if code == 2:
            r = pending_slots(cfg, window_slots)
            shapes.update(pend_kv=S((batch, r, d), dtype),
                          pend_gate=S((batch, r, d), jnp.float32))
    return shapes


def pending_slots(cfg: ModelConfig, window_slots: int) -> int:
    """R_p: slots of a code-2 source's raw kappa / gate ring (`V41DecodeState`)."""
    return 2 + window_slots - cfg.sliding_window


def token_slots(cfg: ModelConfig, window_slots: int) -> int:
    """R_t: slots of the raw-id ring that holds Engram's n-gram context (`V41DecodeState`)."""
    return cfg.engram_max_ngram_size + window_slots - cfg.sliding_window


def init_v41_state(cfg: ModelConfig, batch: int, max_len: int, *,
                   window_slots: int | None = None, dtype=jnp.float32) -> V41DecodeState:
    """An empty V4.1 state for `batch` sequences of up to `max_len` tokens. window_slots
    (default sliding_window): sliding_window + k - 1 for k-token draft verification."""
    if not cfg.is_v41:
        raise ArgumentError(f"init_v41_state needs a DeepSeek-V4.1 config, got model_type="
                            f"{cfg.model_type!r}")
    positive_int("init_v41_state", "batch", batch)
    positive_int("init_v41_state", "max_len", max_len)
    if window_slots is not None:
        positive_int("init_v41_state", "window_slots", window_slots)
    float_dtype("init_v41_state", "dtype", dtype)
    window_slots = window_slots or cfg.sliding_window
    if window_slots < cfg.sliding_window:
        raise ArgumentError(f"window_slots={window_slots} < sliding_window={cfg.sliding_window}")
    if max_len > cfg.max_position_embeddings:
        raise ArgumentError(f"max_len={max_len} > max_position_embeddings={cfg.max_position_embeddings}")
    layers = LayerStack.from_layers(layer_groups(cfg), [
        {k: _initial(k, v) for k, v in
         v41_layer_state_shapes(cfg, i, batch, max_len, window_slots, dtype).items()}
        for i in range(cfg.num_hidden_layers)])
    ring = jnp.full((batch, token_slots(cfg, window_slots)), cfg.engram_pad_token_id, jnp.int32)
    return V41DecodeState(layers, ring, jnp.zeros((batch,), jnp.int32), max_len,
                          window_slots)
