"""Layer groups: the layer stack as unrolled layers plus one scanned repeated unit.

Contract (params, decode state, engine state and the forward passes all follow it):

* `layer_groups(cfg) -> tuple[LayerGroup, ...]` (static, hashable, cached) covers layers
  0 .. L-1 in order. Each layer's kind is (attention type, mlp type). A group is either one
  unrolled layer (`scanned=False`, `repeats=1`, one kind) or a scanned group: a unit of
  `len(kinds)` consecutive layer kinds repeated `repeats` times (`repeats >= 1`), run as one
  `lax.scan` step per repeat. The scanned unit is the one that minimises the number of
  distinct layer bodies compiled (unrolled layers + unit length), ties to the earliest start
  and then most repeats: V4-Flash = layers 0, 1, 2 unrolled, then 20 x [HCA, CSA]. Without
  any repetition, the longest suffix (>= 2 layers) with one mlp type is scanned once (so
  `tiny` still runs the scan). `cfg.scan_layers=False`: every layer unrolled.
* `LayerStack` is the pytree holding per-layer trees in that grouping: `blocks[g]` is a
  tuple with one tree per unit position; an unrolled group's tree is the layer's own dict, a
  scanned group's tree has a leading [repeats] axis on every leaf (layer
  `start + r * unit + j` is `blocks[g][j]` at index r). For decode states the batch axis is
  therefore 1 on stacked leaves, 0 on unrolled ones. Read-only per-layer access works as on
  a tuple: `len(stack)`, `stack[i]` (a dict of slices), iteration. `LayerStack.from_layers`
  builds one from per-layer trees (stacking with `stack`), `to_layers` goes back.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from deepinfer_fn.config import ModelConfig

Kind = tuple[str, str]          # (attention layer type, mlp layer type)


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """Layers start .. stop-1: `kinds` (the unit) repeated `repeats` times."""

    start: int
    kinds: tuple[Kind, ...]
    repeats: int
    scanned: bool

    def __post_init__(self):
        assert self.repeats >= 1 and self.kinds, self
        assert self.scanned or (self.repeats == 1 and len(self.kinds) == 1), self

    @property
    def unit(self) -> int:
        return len(self.kinds)

    @property
    def stop(self) -> int:
        return self.start + self.unit * self.repeats

    def locate(self, layer: int) -> tuple[int, int]:
        """(repeat r, unit position j) of a layer id inside this group."""
        r, j = divmod(layer - self.start, self.unit)
        assert 0 <= r < self.repeats, (layer, self)
        return r, j


def layer_kinds(cfg: ModelConfig) -> tuple[Kind, ...]:
    """Each layer's kind: (attention type, mlp type) for V4; V4.1 appends its sharing and
    Engram roles, so layers stacked together have the same weights and state."""
    return cfg.layer_kinds()


def layer_groups(cfg: ModelConfig) -> tuple[LayerGroup, ...]:
    """The grouping of `cfg`'s layers (module docstring)."""
    return groups_of(layer_kinds(cfg), cfg.scan_layers)


def _repeats(kinds, s: int, u: int) -> int:
    r = 1
    while s + (r + 1) * u <= len(kinds) and kinds[s + r * u:s + (r + 1) * u] == kinds[s:s + u]:
        r += 1
    return r


@functools.lru_cache(maxsize=None)
def groups_of(kinds: tuple[Kind, ...], scan: bool = True) -> tuple[LayerGroup, ...]:
    """Groups for a sequence of layer kinds (module docstring)."""
    L = len(kinds)
    unrolled = lambda lo, hi: tuple(LayerGroup(i, (kinds[i],), 1, False) for i in range(lo, hi))
    if not scan:
        return unrolled(0, L)
    best = None                                        # (cost, start, -repeats, unit)
    for s in range(L):
        for u in range(1, (L - s) // 2 + 1):
            r = _repeats(kinds, s, u)
            if r >= 2:
                key = (L - u * r + u, s, -r, u)
                best = key if best is None or key < best else best
    if best is not None:
        _, s, r, u = best
        r = -r
    else:                                              # no repetition: scan a suffix once
        s = L - 1
        while s > 0 and kinds[s - 1][1] == kinds[-1][1]:
            s -= 1
        if L - s < 2:
            return unrolled(0, L)
        u, r = L - s, 1
    return unrolled(0, s) + (LayerGroup(s, kinds[s:s + u], r, True),) + unrolled(s + u * r, L)


def _stack_leaves(trees: Sequence[Any], stack: Callable) -> Any:
    return jax.tree.map(lambda *xs: stack(xs), *trees, is_leaf=_is_spec_like)


def _is_spec_like(x) -> bool:
    return hasattr(x, "unstack")


def _take(x, r: int):
    """Layer r of a stacked leaf (arrays: x[r]; spec-like leaves: their `unstack()`; abstract
    arrays: the shape of one layer)."""
    if _is_spec_like(x):
        return x.unstack()
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    return x[r]


@jax.tree_util.register_pytree_with_keys_class
class LayerStack:
    """Per-layer trees grouped by `groups` (module docstring). A pytree; `groups` is static."""

    def __init__(self, groups: tuple[LayerGroup, ...], blocks: tuple):
        self.groups = groups
        self.blocks = blocks

    # ---- pytree
    def tree_flatten_with_keys(self):
        return ((jax.tree_util.GetAttrKey("blocks"), self.blocks),), self.groups

    def tree_flatten(self):
        return (self.blocks,), self.groups

    @classmethod
    def tree_unflatten(cls, groups, children):
        return cls(groups, children[0])

    # ---- construction
    @classmethod
    def from_layers(cls, groups: tuple[LayerGroup, ...], layers: Sequence[Any],
                    stack: Callable = jnp.stack) -> "LayerStack":
        """From one tree per layer (a tuple of dicts); `stack(list) -> leaf` builds the leaves
        of scanned groups (default `jnp.stack`, leading axis)."""
        layers = tuple(layers)
        n = groups[-1].stop if groups else 0
        if len(layers) != n:
            raise ValueError(f"{len(layers)} layer trees for a {n}-layer grouping")
        blocks = []
        for g in groups:
            if not g.scanned:
                blocks.append((layers[g.start],))
                continue
            blocks.append(tuple(
                _stack_leaves([layers[g.start + r * g.unit + j] for r in range(g.repeats)], stack)
                for j in range(g.unit)))
        return cls(groups, tuple(blocks))

    def to_layers(self) -> tuple:
        return tuple(self)

    def map_blocks(self, fn: Callable, *others: "LayerStack") -> "LayerStack":
        """fn(scanned: bool, tree, *other_trees) -> tree, for every unit position of every
        group (the others: stacks of the same grouping)."""
        for o in others:
            assert o.groups == self.groups, "LayerStacks of different groupings"
        return LayerStack(self.groups, tuple(
            tuple(fn(g.scanned, t, *(o.blocks[gi][j] for o in others))
                  for j, t in enumerate(self.blocks[gi]))
            for gi, g in enumerate(self.groups)))

    # ---- read-only per-layer view
    def __len__(self) -> int:
        return self.groups[-1].stop if self.groups else 0

    def group_of(self, layer: int) -> int:
        for gi, g in enumerate(self.groups):
            if g.start <= layer < g.stop:
                return gi
        raise IndexError(f"layer {layer} out of range for {len(self)} layers")

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self[k] for k in range(*i.indices(len(self))))
        if i < 0:
            i += len(self)
        gi = self.group_of(i)
        g = self.groups[gi]
        r, j = g.locate(i)
        tree = self.blocks[gi][j]
        if not g.scanned:
            return tree
        return jax.tree.map(lambda x: _take(x, r), tree, is_leaf=_is_spec_like)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __repr__(self):
        return f"LayerStack({len(self)} layers, groups={self.groups})"


def as_stack(groups: tuple[LayerGroup, ...], layers, stack: Callable = jnp.stack) -> LayerStack:
    """`layers` in the grouping `groups`: a LayerStack of that grouping as is; a tuple of
    per-layer trees or a LayerStack of another grouping restacked."""
    if isinstance(layers, LayerStack):
        if layers.groups == groups:
            return layers
        layers = layers.to_layers()
    return LayerStack.from_layers(groups, layers, stack)
