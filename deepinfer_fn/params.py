"""Parameters: one abstract description per weight, from which init, loading and sharding fold.

`param_specs(cfg)` returns a pytree (nested dicts and tuples) of `Spec` leaves with the same
structure as the weights. Internal layout is `x @ W`: every matrix is stored `[in, out]`
(the checkpoint's `[out, in]` transposed at load), routed experts are stacked `[E, in, out]`,
and `wo_a` is `[G, H/G * d, R_o]` (spec/model.md §2.8). Each spec names its checkpoint tensor
(official name, §5.2) and the format the official checkpoint stores it in (§5.3).

`params["layers"]` is a `layer_groups.LayerStack`: the layers of a scanned group are stacked
along a leading axis named "layers" (specs, arrays alike); `params["layers"][i]` is layer i's
dict. `init_params` draws every layer's values exactly as for the per-layer tree
(`unstacked_specs`), then stacks them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_fn.config import CSA, HASH_MOE, HCA, SWA, ModelConfig
from deepinfer_fn.layer_groups import LayerStack, as_stack, layer_groups

# Checkpoint storage formats of the official release (§5.3).
FP8, FP4, BF16, F32, I64 = "fp8", "fp4", "bf16", "f32", "i64"


@dataclasses.dataclass(frozen=True)
class Spec:
    """What one weight is: shape/dtype/logical axes, how to initialise it, where it is stored.

    `ckpt` is the official checkpoint name relative to the block prefix; for stacked experts it
    contains `{e}`. `layout` says how the checkpoint tensor(s) map to the internal array:
    'vector' (as is), 'linear' ([out,in] -> [in,out]), 'experts' (E x [out,in] -> [E,in,out]),
    'grouped' (wo_a: [G*R, H/G*d] -> [G, H/G*d, R]), 'index' (int64 table -> int32).
    `keep_fp32` marks weights that stay float32 whatever the serving dtype (§2.12).
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]
    ckpt: str
    fmt: str
    layout: str = "vector"
    keep_fp32: bool = False
    dtype: Any = jnp.float32

    def __post_init__(self):
        assert len(self.shape) == len(self.axes), (self.ckpt, self.shape, self.axes)

    @property
    def stacked(self) -> bool:
        """A scanned group's weight: leading axis "layers" over the group's repeats."""
        return self.axes[:1] == (LAYERS_AXIS,)

    def unstack(self) -> "Spec":
        """The spec of one layer of a stacked weight."""
        assert self.stacked, self
        return dataclasses.replace(self, shape=self.shape[1:], axes=self.axes[1:])


LAYERS_AXIS = "layers"


def stack_specs(specs) -> Spec:
    """One stacked spec (leading "layers" axis) for the same weight of several layers."""
    s = specs[0]
    assert all(x.shape == s.shape and x.axes == s.axes for x in specs), specs
    return dataclasses.replace(s, shape=(len(specs),) + s.shape, axes=(LAYERS_AXIS,) + s.axes)


@dataclasses.dataclass(frozen=True)
class StackedPrefix:
    """The checkpoint prefixes ('layers.3.', ...) of a stacked weight, one per repeat."""

    prefixes: tuple[str, ...]


def per_layer(spec: Spec, prefix) -> list[tuple[Spec, str]]:
    """(per-layer spec, checkpoint prefix) of each layer a (possibly stacked) weight holds."""
    if spec.stacked:
        return [(spec.unstack(), p) for p in prefix.prefixes]
    return [(spec, prefix)]


# --------------------------------------------------------------------------------- params
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Params:
    """Model weights (a pytree of arrays) with the config as static metadata."""

    weights: dict[str, Any]
    config: ModelConfig = dataclasses.field(metadata=dict(static=True))

    def __post_init__(self):
        # Per-layer trees (a tuple of dicts) or another grouping: restacked to the config's.
        w = self.weights
        if isinstance(w, dict) and isinstance(w.get("layers"), (tuple, list, LayerStack)):
            layers = as_stack(layer_groups(self.config), w["layers"])
            if layers is not w["layers"]:
                object.__setattr__(self, "weights", {**w, "layers": layers})

    def __getitem__(self, key):
        return self.weights[key]

    @property
    def dtype(self):
        return self.weights["embed"].dtype


# --------------------------------------------------------------------------------- inits
# Initialisers are numpy functions (rng, shape) -> float32/int32 array: no XLA compilation
# per weight shape, so a random model builds in milliseconds on CPU.
def normal(std: float, mean: float = 0.0):
    def init(rng: np.random.Generator, shape):
        return (mean + std * rng.standard_normal(shape, np.float32)).astype(np.float32)
    return init


def fan_in(scale: float = 1.0, axis: int = -2):
    """N(0, scale^2 / fan_in): keeps activations O(1) through a random network."""
    def init(rng, shape):
        std = scale / math.sqrt(shape[axis])
        return (std * rng.standard_normal(shape, np.float32)).astype(np.float32)
    return init


def hash_table(n_experts: int, k: int):
    """tid2eid: k distinct experts per token id, spread uniformly over the experts (§6.4)."""
    def init(rng, shape):
        noise = rng.random((shape[0], n_experts), np.float32)
        return np.argsort(noise, axis=-1)[:, :k].astype(np.int32)
    return init


# --------------------------------------------------------------------------------- specs
def _linear(d_in, d_out, name, fmt, axes, scale=1.0, keep_fp32=False):
    return Spec((d_in, d_out), axes, fan_in(scale), name, fmt, "linear", keep_fp32)


def _norm(dim, name, axis="norm"):
    return Spec((dim,), (axis,), normal(0.1, 1.0), name, BF16, keep_fp32=True)


def _compressor_specs(cfg: ModelConfig, ratio: int, dim: int, overlap: bool, prefix: str):
    c = 2 if overlap else 1
    d_model = cfg.hidden_size
    return {
        "wkv": _linear(d_model, c * dim, f"{prefix}wkv.weight", BF16, ("embed", "compress")),
        "wgate": _linear(d_model, c * dim, f"{prefix}wgate.weight", BF16, ("embed", "compress")),
        "ape": Spec((ratio, c * dim), (None, "compress"), normal(0.1), f"{prefix}ape", F32,
                    keep_fp32=True),
        "norm": _norm(dim, f"{prefix}norm.weight"),
    }


def attention_specs(cfg: ModelConfig, layer_type: str) -> dict[str, Any]:
    """Attention of one layer (§2.5-§2.8): projections, sinks, compressor and indexer."""
    D, H, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    G, R = cfg.o_groups, cfg.o_lora_rank
    specs = {
        "wq_a": _linear(D, cfg.q_lora_rank, "attn.wq_a.weight", FP8, ("embed", "q_lora")),
        "q_norm": _norm(cfg.q_lora_rank, "attn.q_norm.weight"),
        "wq_b": _linear(cfg.q_lora_rank, H * d, "attn.wq_b.weight", FP8, ("q_lora", "q_heads")),
        "wkv": _linear(D, d, "attn.wkv.weight", FP8, ("embed", "head_dim")),
        "kv_norm": _norm(d, "attn.kv_norm.weight"),
        "wo_a": Spec((G, H // G * d, R), ("o_groups", "o_group_in", "o_lora"), fan_in(1.0),
                     "attn.wo_a.weight", FP8, "grouped"),
        "wo_b": _linear(G * R, D, "attn.wo_b.weight", FP8, ("o_lora_all", "embed")),
        "sinks": Spec((H,), ("heads",), normal(0.5), "attn.attn_sink", F32, keep_fp32=True),
    }
    if layer_type == CSA:
        specs["compressor"] = _compressor_specs(cfg, cfg.csa_ratio, d, True, "attn.compressor.")
        HI, dI = cfg.index_n_heads, cfg.index_head_dim
        specs["indexer"] = {
            "compressor": _compressor_specs(cfg, cfg.csa_ratio, dI, True,
                                            "attn.indexer.compressor."),
            "wq_b": _linear(cfg.q_lora_rank, HI * dI, "attn.indexer.wq_b.weight", FP8,
                            ("q_lora", "index_heads")),
            "weights_proj": _linear(D, HI, "attn.indexer.weights_proj.weight", BF16,
                                    ("embed", "index_heads_w")),
        }
    elif layer_type == HCA:
        specs["compressor"] = _compressor_specs(cfg, cfg.hca_ratio, d, False, "attn.compressor.")
    return specs


def moe_specs(cfg: ModelConfig, mlp_type: str) -> dict[str, Any]:
    """MoE of one layer (§2.9): router (score or hash), routed experts, shared expert."""
    D, E, I, k = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    specs = {
        "gate": _linear(D, E, "ffn.gate.weight", BF16, ("embed", "expert_logits"), scale=1.0),
        "w1": Spec((E, D, I), ("expert", "embed", "mlp"), fan_in(1.0), "ffn.experts.{e}.w1.weight",
                   FP4, "experts"),
        "w3": Spec((E, D, I), ("expert", "embed", "mlp"), fan_in(1.0), "ffn.experts.{e}.w3.weight",
                   FP4, "experts"),
        "w2": Spec((E, I, D), ("expert", "mlp", "embed"), fan_in(1.0), "ffn.experts.{e}.w2.weight",
                   FP4, "experts"),
    }
    if mlp_type == HASH_MOE:
        specs["tid2eid"] = Spec((cfg.vocab_size, k), ("vocab", None), hash_table(E, k),
                                "ffn.gate.tid2eid", I64, "index", dtype=jnp.int32)
    else:
        specs["gate_bias"] = Spec((E,), ("expert_logits",), normal(0.5), "ffn.gate.bias", F32,
                                  keep_fp32=True)
    if cfg.n_shared_experts:
        specs["shared"] = {
            "w1": _linear(D, I, "ffn.shared_experts.w1.weight", FP8, ("embed", "mlp")),
            "w3": _linear(D, I, "ffn.shared_experts.w3.weight", FP8, ("embed", "mlp")),
            "w2": _linear(I, D, "ffn.shared_experts.w2.weight", FP8, ("mlp", "embed")),
        }
    return specs


def _mhc_specs(cfg: ModelConfig, prefix: str, n_out: int) -> dict[str, Spec]:
    n, D = cfg.hc_mult, cfg.hidden_size
    n_scale = 3 if n_out > n else 1
    return {
        "fn": Spec((n * D, n_out), ("hc_in", None), fan_in(1.0, axis=0), f"{prefix}_fn", F32,
                   "linear", keep_fp32=True),
        "base": Spec((n_out,), (None,), normal(0.5), f"{prefix}_base", F32, keep_fp32=True),
        "scale": Spec((n_scale,), (None,), normal(0.1, 1.0), f"{prefix}_scale", F32,
                      keep_fp32=True),
    }


def layer_specs(cfg: ModelConfig, layer_type: str, mlp_type: str) -> dict[str, Any]:
    n = cfg.hc_mult
    return {
        "hc_attn": _mhc_specs(cfg, "hc_attn", (2 + n) * n),
        "hc_ffn": _mhc_specs(cfg, "hc_ffn", (2 + n) * n),
        "attn_norm": _norm(cfg.hidden_size, "attn_norm.weight"),
        "ffn_norm": _norm(cfg.hidden_size, "ffn_norm.weight"),
        "attn": attention_specs(cfg, layer_type),
        "ffn": moe_specs(cfg, mlp_type),
    }


def mtp_specs(cfg: ModelConfig) -> dict[str, Any]:
    """One MTP block (§2.11): input projections, its own head collapse/norm, one SWA block."""
    D = cfg.hidden_size
    return {
        "e_proj": _linear(D, D, "e_proj.weight", FP8, ("embed", "embed_out")),
        "h_proj": _linear(D, D, "h_proj.weight", FP8, ("embed", "embed_out")),
        "enorm": _norm(D, "enorm.weight"),
        "hnorm": _norm(D, "hnorm.weight"),
        "norm": _norm(D, "norm.weight"),
        "hc_head": _mhc_specs(cfg, "hc_head", cfg.hc_mult),
        "block": layer_specs(cfg, SWA, "moe"),
    }


def unstacked_specs(cfg: ModelConfig, include_mtp: bool = True) -> dict[str, Any]:
    """`param_specs` with "layers" a plain tuple of per-layer spec dicts (the init order)."""
    specs = param_specs(cfg, include_mtp)
    return {**specs, "layers": tuple(specs["layers"])}


def param_specs(cfg: ModelConfig, include_mtp: bool = True) -> dict[str, Any]:
    """The abstract description of every weight of the model (same tree as `Params.weights`)."""
    V, D = cfg.vocab_size, cfg.hidden_size
    return {
        "embed": Spec((V, D), ("vocab", "embed"), normal(1.0), "embed.weight", BF16),
        "layers": LayerStack.from_layers(
            layer_groups(cfg), [layer_specs(cfg, lt, mt)
                                for lt, mt in zip(cfg.layer_types, cfg.mlp_layer_types)],
            stack=stack_specs),
        "hc_head": _mhc_specs(cfg, "hc_head", cfg.hc_mult),
        "norm": _norm(D, "norm.weight"),
        "head": _linear(D, V, "head.weight", BF16, ("embed", "vocab")),
        "mtp": tuple(mtp_specs(cfg) for _ in range(cfg.num_mtp_layers if include_mtp else 0)),
    }


def ckpt_prefixes(cfg: ModelConfig, specs: dict[str, Any]) -> dict[str, Any]:
    """Same tree as the specs, each leaf the official name prefix of its block ('layers.3.')."""
    def prefixed(tree, prefix):
        return jax.tree.map(lambda s: prefix, tree, is_leaf=lambda x: isinstance(x, Spec))
    return {
        **{k: prefixed(specs[k], "") for k in ("embed", "hc_head", "norm", "head")},
        "layers": LayerStack.from_layers(
            specs["layers"].groups,
            [prefixed(l, f"layers.{i}.") for i, l in enumerate(specs["layers"])],
            stack=lambda xs: StackedPrefix(tuple(xs))),
        "mtp": tuple({**prefixed({k: v for k, v in m.items() if k != "block"}, f"mtp.{i}."),
                      "block": prefixed(m["block"], f"mtp.{i}.")}
                     for i, m in enumerate(specs["mtp"])),
    }


def is_spec(x) -> bool:
    return isinstance(x, Spec)


def leaf_dtype(spec: Spec, dtype) -> Any:
    """The dtype a weight is held in when the model runs in `dtype` (§2.12)."""
    if spec.dtype != jnp.float32:
        return spec.dtype
    return jnp.float32 if spec.keep_fp32 else dtype


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32,
                include_mtp: bool = True) -> Params:
    """Random weights with realistic scales: non-zero sinks/biases/ape, spread hash tables.

    Every layer's values are those of the per-layer tree (`unstacked_specs`, leaf i seeded by
    (key, i)) whatever the grouping; scanned groups stack them."""
    specs = unstacked_specs(cfg, include_mtp)
    values = _init_numpy(specs, key)
    values["layers"] = LayerStack.from_layers(layer_groups(cfg), values["layers"], stack=np.stack)
    stacked = param_specs(cfg, include_mtp)
    weights = jax.tree.map(lambda s, v: jnp.asarray(v, dtype=leaf_dtype(s, dtype)), stacked, values,
                           is_leaf=is_spec)
    return Params(weights, cfg)


def _init_numpy(specs, key: jax.Array):
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    seed = [int(x) for x in np.asarray(jax.random.key_data(key)).reshape(-1)]
    values = []
    for i, spec in enumerate(leaves):
        rng = np.random.default_rng(seed + [i])
        values.append(spec.init(rng, spec.shape))
    return jax.tree.unflatten(treedef, values)


def init_tree(specs, key: jax.Array, dtype=jnp.float32):
    """Values for a tree of (unstacked) `Spec`s: leaf i from numpy's generator seeded by
    (key, i)."""
    return jax.tree.map(lambda s, v: jnp.asarray(v, dtype=leaf_dtype(s, dtype)), specs,
                        _init_numpy(specs, key), is_leaf=is_spec)


def abstract_tree(specs, dtype=jnp.float32, shardings=None):
    """The `jax.ShapeDtypeStruct` of every weight of a spec tree (no allocation); shardings:
    an optional tree of shardings of the same structure."""
    if shardings is None:
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, leaf_dtype(s, dtype)), specs,
                            is_leaf=is_spec)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, leaf_dtype(s, dtype),
                                                           sharding=sh), specs, shardings,
                        is_leaf=is_spec)


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Total and per-token active parameter counts from the specs (§1.4).

    Active: everything dense (embedding table and head included, as the model card counts)
    plus `num_experts_per_tok` routed experts per MoE layer. hash tables are not parameters.
    """
    def count(tree, active: bool):
        total = 0
        for path, s in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_spec)[0]:
            if s.layout == "index":
                continue
            size = math.prod(s.shape)
            if active and s.layout == "experts":
                size = size // cfg.n_routed_experts * cfg.num_experts_per_tok
            total += size
        return total

    specs = param_specs(cfg)
    backbone = {k: v for k, v in specs.items() if k != "mtp"}
    return {
        "total": count(backbone, False),
        "active": count(backbone, True),
        "mtp_total": count(specs["mtp"], False),
        "mtp_active": count(specs["mtp"], True),
    }
