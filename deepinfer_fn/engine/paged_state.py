"""Device state of the engine: per-slot rings plus paged pools of compressed rows.

The decode state of docs/MODEL.md §3 splits in two (§7):

* per slot (one running request), fixed size: the window KV ring (`window_kv`, `window_pos`)
  and the compressor rings (`raw_kv`, `raw_gate`, and the indexer's `index_raw_*`) of every
  layer, shaped as `state.DecodeState` lays them out but with the batch axis = `max_batch`
  slots;
* shared, growing: the compressed rows (`rows` of CSA/HCA layers, `index_rows` of CSA
  layers) in per-layer POOLS `[num_pages, page_size // m, d]`. Rows are stored once per token
  block, not per head (one row serves every head, MQA). A page holds the rows of `page_size`
  consecutive token positions in every compressed layer (page_size is a multiple of every
  ratio), so one page id addresses one token block everywhere and a block table
  `[max_batch, max_pages]` (host side) maps a request's block i to its page.

Both `slots` and `pools` are `layer_groups.LayerStack`s in the model's grouping: on a scanned
group's leaves the leading axis is the group's repeats (slot axis 1, page axis 1).

`last_token [max_batch]` holds each slot's last sampled token, so a decode step's inputs never
have to come back from the host (asynchronous scheduling).

`spec` (speculative engines only, else {}): the per-slot speculative state, gathered and
scattered by slot like the rings (`engine.spec_step.init_spec_slots`): the committed length
`length` (= the anchor's position; a verify step advances it by 1..γ+1, known only on device),
the token budget `left` (tokens the request may still emit), the request-local verify-step
counter `step` (the counter-based draft/accept keys), and `drafter`, the drafter's own per-row
state (any pytree with the batch axis leading; `speculative.drafter.Drafter.init_state`).

DeepSeek-V4.1 (`cfg.is_v41`, docs/MODEL.md §V3): the rings are `state.V41DecodeState`'s
(`window_kv` / `window_pos` on every layer, `pend_kv` / `pend_gate` at code-2 kv sources), the
pools hold `rows` and `keys` of the kv-source layers only ([P, page_size // code, d] and
[P, page_size // code, d_I], code in {1, 2}: page_size is a multiple of every code, so one
page again addresses the same token block at every source layer), and `token_ring
[max_batch, R_t]` int32 holds each slot's recent token ids (Engram's n-gram history; None for
V4).

On a mesh (`shard_axes`) the slot axis of every per-slot array and the page axis of every pool
are split over the batch axes dp x ep: shard i owns slots [i * max_batch / n, (i + 1) *
max_batch / n) and pages [i * P, (i + 1) * P) (its own pool of P pages, addressed by
shard-local ids 0..P-1, local page 0 its null page).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from deepinfer_fn.config import CSA, HCA, ModelConfig
from deepinfer_fn.errors import ArgumentError, ArgumentTypeError
from deepinfer_fn.layer_groups import LayerStack, layer_groups
from deepinfer_fn.state import state_shapes, token_slots, v41_layer_state_shapes

POOL_KEYS = ("rows", "index_rows", "keys")      # V4: rows, index_rows; V4.1: rows, keys


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedState:
    slots: LayerStack     # per layer: per-slot rings [max_batch, ...]
    pools: LayerStack     # per layer: {} (SWA) or rows pools [P, ps//m, d]
    last_token: jax.Array                     # [max_batch] int32
    page_size: int = dataclasses.field(metadata=dict(static=True))
    max_pages: int = dataclasses.field(metadata=dict(static=True))
    window_slots: int = dataclasses.field(metadata=dict(static=True))
    spec: dict = dataclasses.field(default_factory=dict)      # speculative per-slot state
    token_ring: jax.Array | None = None       # V4.1: [max_batch, R_t] int32; V4: None

    @property
    def max_batch(self) -> int:
        return self.last_token.shape[0]

    @property
    def max_len(self) -> int:
        return self.page_size * self.max_pages


def shard_axes(state: PagedState) -> PagedState:
    """The axis of every leaf that the batch shards split (a PagedState of ints): the slot axis
    of the rings, `last_token` and `spec`, the page axis of the pools (1 on the stacked leaves
    of a scanned group, else 0)."""
    lead = lambda stack: stack.map_blocks(
        lambda scanned, tree: jax.tree.map(lambda _: int(scanned), tree))
    return dataclasses.replace(state, slots=lead(state.slots), pools=lead(state.pools),
                               last_token=0, spec=jax.tree.map(lambda _: 0, state.spec),
                               token_ring=None if state.token_ring is None else 0)


def compression_ratios(cfg: ModelConfig) -> tuple[int, ...]:
    """The distinct token-per-row ratios of the layers with paged rows: V4 the CSA / HCA
    ratios m, V4.1 the codes of the kv sources (1, 2)."""
    if cfg.is_v41:
        return tuple(sorted({cfg.compress_ratio(i) for i in cfg.kv_source_layer_ids}))
    return tuple(sorted({cfg.compress_ratio_of(t) for t in cfg.layer_types if t in (CSA, HCA)}))


def check_page_size(cfg: ModelConfig, page_size: int) -> None:
    ratios = compression_ratios(cfg)
    bad = [m for m in ratios if page_size % m]
    if isinstance(page_size, bool) or not isinstance(page_size, int):
        raise ArgumentTypeError(f"page_size must be an int, got {page_size!r}")
    if page_size < 1 or bad:
        raise ArgumentError(f"page_size={page_size} must be a positive multiple of every "
                            f"compression ratio {sorted(set(ratios))}")


def init_paged_state(cfg: ModelConfig, *, max_batch: int, num_pages: int, page_size: int,
                     max_pages: int, dtype, window_slots: int | None = None) -> PagedState:
    """Zeroed pools, empty rings (window_pos = -1) for `max_batch` slots."""
    check_page_size(cfg, page_size)
    window_slots = window_slots or cfg.sliding_window
    max_len = page_size * max_pages
    shapes = (v41_state_shapes(cfg, max_batch, max_len, window_slots, dtype) if cfg.is_v41
              else state_shapes(cfg, max_batch, max_len, window_slots, dtype))

    def slot(scanned, tree):
        return {k: (jnp.full(s.shape, -1, s.dtype) if k == "window_pos" else jnp.zeros(s.shape, s.dtype))
                for k, s in tree.items() if k not in POOL_KEYS}

    def pool(scanned, tree):
        lead = tree["window_kv"].shape[:1] if scanned else ()
        # rows [(R,) B, cap, d] -> pool [(R,) P, ps // m, d]; cap = max_len // m
        return {k: jnp.zeros(lead + (num_pages, page_size * s.shape[-2] // max_len, s.shape[-1]),
                             s.dtype)
                for k, s in tree.items() if k in POOL_KEYS}

    ring = None
    if cfg.is_v41:
        ring = jnp.full((max_batch, token_slots(cfg, window_slots)), cfg.engram_pad_token_id,
                        jnp.int32)
    return PagedState(shapes.map_blocks(slot), shapes.map_blocks(pool),
                      jnp.zeros((max_batch,), jnp.int32), page_size, max_pages, window_slots,
                      token_ring=ring)


def v41_state_shapes(cfg: ModelConfig, batch: int, max_len: int, window_slots: int,
                     dtype) -> LayerStack:
    """The `V41DecodeState.layers` shapes of `cfg` (stacked per `layer_groups`)."""
    stack = lambda xs: jax.ShapeDtypeStruct((len(xs),) + xs[0].shape, xs[0].dtype)
    return LayerStack.from_layers(
        layer_groups(cfg), [v41_layer_state_shapes(cfg, i, batch, max_len, window_slots, dtype)
                            for i in range(cfg.num_hidden_layers)], stack=stack)


def pool_bytes_per_page(cfg: ModelConfig, page_size: int, dtype) -> int:
    """Bytes one page occupies across all layers' pools."""
    total = 0
    if cfg.is_v41:          # kv sources: latents [ps // code, d] + index keys [ps // code, dI]
        for i in cfg.kv_source_layer_ids:
            total += (page_size // cfg.compress_ratio(i) * (cfg.head_dim + cfg.index_head_dim)
                      * jnp.dtype(dtype).itemsize)
        return total
    for lt in cfg.layer_types:
        if lt in (CSA, HCA):
            m = cfg.compress_ratio_of(lt)
            d = cfg.head_dim + (cfg.index_head_dim if lt == CSA else 0)
            total += page_size // m * d * jnp.dtype(dtype).itemsize
    return total
