"""Decode state: everything a sequence carries between calls (spec/model.md §3).

Contiguous layout (one slot per batch row). Per layer, a dict of fixed-capacity arrays:

  window_kv   [B, W_slots, d]   rotated KV of the last tokens, ring slot = position % W_slots
  window_pos  [B, W_slots]      absolute position held by each slot (-1 = empty)
  CSA / HCA (ratio m, c = 2 for CSA, 1 for HCA):
  rows        [B, R, d]         compressed rows, row w at index w; R = max_len // m
  part_kv     [B, m, c*d]       raw kappa of the unfinished window (slot = position % m)
  part_gate   [B, m, c*d] f32   its gate + ape
  CSA only:
  ovl_kv      [B, m, d]         A-halves of the last finished window (candidates of the next row)
  ovl_gate    [B, m, d] f32     (-inf before the first window finishes)
  index_rows, index_part_kv, index_part_gate, index_ovl_kv, index_ovl_gate: the same for
  the lightning indexer's own compressor (dimension d_I).

`lengths [B]` counts the tokens each row has processed (= next position). Row counts and
partial fills are derived from it (rows = lengths // m, fill = lengths % m), so rolling a
row back is only `lengths` moving back, provided the window ring has room for the rolled
back tokens (W_slots >= window + draft - 1: spec/dspark.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from deepinfer_fn.config import CSA, HCA, SWA, ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    layers: tuple[dict[str, jax.Array], ...]
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
        shapes.update(rows=S((batch, cap, d), dtype), part_kv=S((batch, m, c * d), dtype),
                      part_gate=S((batch, m, c * d), f32))
        if layer_type == CSA:
            dI = cfg.index_head_dim
            shapes.update(ovl_kv=S((batch, m, d), dtype), ovl_gate=S((batch, m, d), f32),
                          index_rows=S((batch, cap, dI), dtype),
                          index_part_kv=S((batch, m, 2 * dI), dtype),
                          index_part_gate=S((batch, m, 2 * dI), f32),
                          index_ovl_kv=S((batch, m, dI), dtype),
                          index_ovl_gate=S((batch, m, dI), f32))
    return shapes


def _initial(name: str, shape: jax.ShapeDtypeStruct) -> jax.Array:
    if name == "window_pos":
        return jnp.full(shape.shape, -1, shape.dtype)
    if name.endswith("ovl_gate"):
        return jnp.full(shape.shape, -jnp.inf, shape.dtype)
    return jnp.zeros(shape.shape, shape.dtype)


def init_state(cfg: ModelConfig, batch: int, max_len: int, *, window_slots: int | None = None,
               dtype=jnp.float32) -> DecodeState:
    """An empty state for `batch` sequences of up to `max_len` tokens.

    window_slots defaults to the sliding window; speculative decoding with draft length k
    needs sliding_window + k - 1 slots so rejected tokens never overwrite live entries.
    """
    window_slots = window_slots or cfg.sliding_window
    if window_slots < cfg.sliding_window:
        raise ValueError(f"window_slots={window_slots} < sliding_window={cfg.sliding_window}")
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"max_len={max_len} > max_position_embeddings={cfg.max_position_embeddings}")
    layers = tuple(
        {k: _initial(k, v) for k, v in
         layer_state_shapes(cfg, lt, batch, max_len, window_slots, dtype).items()}
        for lt in cfg.layer_types)
    return DecodeState(layers, jnp.zeros((batch,), jnp.int32), max_len, window_slots)


def state_bytes(cfg: ModelConfig, batch: int, max_len: int, window_slots: int | None = None,
                dtype=jnp.bfloat16) -> int:
    """Bytes of a decode state (for memory planning and the roofline)."""
    window_slots = window_slots or cfg.sliding_window
    total = 0
    for lt in cfg.layer_types:
        for s in layer_state_shapes(cfg, lt, batch, max_len, window_slots, dtype).values():
            total += s.size * jnp.dtype(s.dtype).itemsize
    return total + 4 * batch
