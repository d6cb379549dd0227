"""Parameters: one abstract description per weight, from which init, loading and sharding fold.

`param_specs(cfg)` returns a pytree (nested dicts and tuples) of `Spec` leaves with the same
structure as the weights. Internal layout is `x @ W`: every matrix is stored `[in, out]`
(the checkpoint's `[out, in]` transposed at load), routed experts are stacked `[E, in, out]`,
and `wo_a` is `[G, H/G * d, R_o]` (docs/MODEL.md §2.8). Each spec names its checkpoint tensor
(official name, §5.2) and the format the official checkpoint stores it in (§5.3).

`params["layers"]` is a `layer_groups.LayerStack`: the layers of a scanned group are stacked
along a leading axis named "layers" (specs, arrays alike); `params["layers"][i]` is layer i's
dict. `init_params` draws every layer's values exactly as for the per-layer tree
(`unstacked_specs`), then stacks them.

DeepSeek-V4.1 (`cfg.is_v41`, docs/MODEL.md §V1.4, §6.2): `v41_param_specs` — per-layer roles
(compressor / index keys at kv sources, index queries at index sources), `gate_bias_vl`, Engram
tables held as raw FP8 bytes + UE8M0 scales, no `hc_head`; "mtp" is the DSpark drafter.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_fn.config import CSA, HASH_MOE, HCA, SCORE_MOE, SWA, ModelConfig
from deepinfer_fn.layer_groups import LayerStack, as_stack, layer_groups

# Checkpoint storage formats of the official release (§5.3).
FP8, FP4, BF16, F32, I64 = "fp8", "fp4", "bf16", "f32", "i64"
# V4.1 Engram tables (docs/MODEL.md §V6.1): F8_E4M3 rows and their F8_E8M0 1x32 scales, both
# held as raw uint8 bytes (never dequantised as a whole; scales are not parameters).
FP8_CODES, E8M0 = "fp8_codes", "e8m0"


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


def model_layer_groups(cfg: ModelConfig):
    """The layer grouping of the params tree (`layer_groups.layer_groups`)."""
    return layer_groups(cfg)


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
            layers = as_stack(model_layer_groups(self.config), w["layers"])
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


def fp8_codes():
    """Random FP8 E4M3 bytes (uint8), uniform over both signs, the biased exponents 4..7
    (magnitudes 2^-3 .. 1.875) and all mantissas: random bytes and bit operations only, so
    multi-GB tables build fast."""
    def init(rng, shape):
        b = np.frombuffer(rng.bytes(math.prod(shape)), np.uint8).reshape(shape)
        return (b & 0x87) | ((((b >> 3) & 3) + 4) << 3).astype(np.uint8)
    return init


def ue8m0_bytes(lo: int = 122, hi: int = 125):
    """Random UE8M0 scale bytes in [lo, hi] (scales 2^(lo-127) .. 2^(hi-127))."""
    def init(rng, shape):
        return rng.integers(lo, hi + 1, shape, np.uint8)
    return init


# --------------------------------------------------------------------------------- specs
def linear_spec(d_in, d_out, name, fmt, axes, scale=1.0, keep_fp32=False):
    """The spec of a [d_in, d_out] projection weight."""
    return Spec((d_in, d_out), axes, fan_in(scale), name, fmt, "linear", keep_fp32)


def norm_spec(dim, name, axis="norm"):
    """The spec of an RMSNorm weight [dim] (kept in float32)."""
    return Spec((dim,), (axis,), normal(0.1, 1.0), name, BF16, keep_fp32=True)


def _compressor_specs(cfg: ModelConfig, ratio: int, dim: int, overlap: bool, prefix: str):
    c = 2 if overlap else 1
    d_model = cfg.hidden_size
    return {
        "wkv": linear_spec(d_model, c * dim, f"{prefix}wkv.weight", BF16, ("embed", "compress")),
        "wgate": linear_spec(d_model, c * dim, f"{prefix}wgate.weight", BF16, ("embed", "compress")),
        "ape": Spec((ratio, c * dim), (None, "compress"), normal(0.1), f"{prefix}ape", F32,
                    keep_fp32=True),
        "norm": norm_spec(dim, f"{prefix}norm.weight"),
    }


def attention_specs(cfg: ModelConfig, layer_type: str) -> dict[str, Any]:
    """Attention of one layer (§2.5-§2.8): projections, sinks, compressor and indexer."""
    D, H, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    G, R = cfg.o_groups, cfg.o_lora_rank
    specs = {
        "wq_a": linear_spec(D, cfg.q_lora_rank, "attn.wq_a.weight", FP8, ("embed", "q_lora")),
        "q_norm": norm_spec(cfg.q_lora_rank, "attn.q_norm.weight"),
        "wq_b": linear_spec(cfg.q_lora_rank, H * d, "attn.wq_b.weight", FP8, ("q_lora", "q_heads")),
        "wkv": linear_spec(D, d, "attn.wkv.weight", FP8, ("embed", "head_dim")),
        "kv_norm": norm_spec(d, "attn.kv_norm.weight"),
        "wo_a": Spec((G, H // G * d, R), ("o_groups", "o_group_in", "o_lora"), fan_in(1.0),
                     "attn.wo_a.weight", FP8, "grouped"),
        "wo_b": linear_spec(G * R, D, "attn.wo_b.weight", FP8, ("o_lora_all", "embed")),
        "sinks": Spec((H,), ("heads",), normal(0.5), "attn.attn_sink", F32, keep_fp32=True),
    }
    if layer_type == CSA:
        specs["compressor"] = _compressor_specs(cfg, cfg.csa_ratio, d, True, "attn.compressor.")
        HI, dI = cfg.index_n_heads, cfg.index_head_dim
        specs["indexer"] = {
            "compressor": _compressor_specs(cfg, cfg.csa_ratio, dI, True,
                                            "attn.indexer.compressor."),
            "wq_b": linear_spec(cfg.q_lora_rank, HI * dI, "attn.indexer.wq_b.weight", FP8,
                            ("q_lora", "index_heads")),
            "weights_proj": linear_spec(D, HI, "attn.indexer.weights_proj.weight", BF16,
                                    ("embed", "index_heads_w")),
        }
    elif layer_type == HCA:
        specs["compressor"] = _compressor_specs(cfg, cfg.hca_ratio, d, False, "attn.compressor.")
    return specs


def moe_specs(cfg: ModelConfig, mlp_type: str) -> dict[str, Any]:
    """MoE of one layer (§2.9): router (score or hash), routed experts, shared expert."""
    D, E, I, k = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    specs = {
        "gate": linear_spec(D, E, "ffn.gate.weight", BF16, ("embed", "expert_logits"), scale=1.0),
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
            "w1": linear_spec(D, I, "ffn.shared_experts.w1.weight", FP8, ("embed", "mlp")),
            "w3": linear_spec(D, I, "ffn.shared_experts.w3.weight", FP8, ("embed", "mlp")),
            "w2": linear_spec(I, D, "ffn.shared_experts.w2.weight", FP8, ("mlp", "embed")),
        }
    return specs


def mhc_specs(cfg: ModelConfig, prefix: str, n_out: int) -> dict[str, Spec]:
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
        "hc_attn": mhc_specs(cfg, "hc_attn", (2 + n) * n),
        "hc_ffn": mhc_specs(cfg, "hc_ffn", (2 + n) * n),
        "attn_norm": norm_spec(cfg.hidden_size, "attn_norm.weight"),
        "ffn_norm": norm_spec(cfg.hidden_size, "ffn_norm.weight"),
        "attn": attention_specs(cfg, layer_type),
        "ffn": moe_specs(cfg, mlp_type),
    }


def mtp_specs(cfg: ModelConfig) -> dict[str, Any]:
    """One MTP block (§2.11): input projections, its own head collapse/norm, one SWA block."""
    D = cfg.hidden_size
    return {
        "e_proj": linear_spec(D, D, "e_proj.weight", FP8, ("embed", "embed_out")),
        "h_proj": linear_spec(D, D, "h_proj.weight", FP8, ("embed", "embed_out")),
        "enorm": norm_spec(D, "enorm.weight"),
        "hnorm": norm_spec(D, "hnorm.weight"),
        "norm": norm_spec(D, "norm.weight"),
        "hc_head": mhc_specs(cfg, "hc_head", cfg.hc_mult),
        "block": layer_specs(cfg, SWA, "moe"),
    }


# ------------------------------------------------------------------------------ V4.1 specs
def v41_attention_specs(cfg: ModelConfig, layer: int | None) -> dict[str, Any]:
    """V4.1 attention of one layer (docs/MODEL.md §V1.3, §1.4, §6.2): the V4 core (own wq_a,
    q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, sink), plus at kv sources a compressor (wkv, norm,
    and wgate for code 2; no ape) and the index key projection (indexer.wk, k_norm), plus at
    index sources the index query projection (indexer.wq_b, weights_proj). layer None: a
    DSpark stage (code 0)."""
    specs = attention_specs(cfg, SWA)
    if layer is None:
        return specs
    D, d, dI, HI = cfg.hidden_size, cfg.head_dim, cfg.index_head_dim, cfg.index_n_heads
    if layer in cfg.kv_source_layer_ids:
        comp = {"wkv": linear_spec(D, d, "attn.compressor.wkv.weight", BF16, ("embed", "compress")),
                "norm": norm_spec(d, "attn.compressor.norm.weight")}
        if cfg.compress_ratio(layer) == 2:
            comp["wgate"] = linear_spec(D, d, "attn.compressor.wgate.weight", BF16,
                                    ("embed", "compress"))
        specs["compressor"] = comp
        specs["indexer"] = {
            "wk": linear_spec(d, dI, "attn.indexer.wk.weight", BF16, ("compress", "index_dim")),
            "k_norm": norm_spec(dI, "attn.indexer.k_norm.weight"),
        }
    if layer in cfg.index_source_layer_ids:
        specs.setdefault("indexer", {}).update({
            "wq_b": linear_spec(cfg.q_lora_rank, HI * dI, "attn.indexer.wq_b.weight", FP8,
                            ("q_lora", "index_heads")),
            "weights_proj": linear_spec(D, HI, "attn.indexer.weights_proj.weight", BF16,
                                    ("embed", "index_heads_w")),
        })
    return specs


def v41_moe_specs(cfg: ModelConfig) -> dict[str, Any]:
    """V4.1 MoE (§2.8): score-routed with `bias`, plus `bias_vl` for image-token rows."""
    specs = moe_specs(cfg, SCORE_MOE)
    specs["gate_bias_vl"] = Spec((cfg.n_routed_experts,), ("expert_logits",), normal(0.5),
                                 "ffn.gate.bias_vl", F32, keep_fp32=True)
    return specs


def engram_specs(cfg: ModelConfig, rows: int) -> dict[str, Spec]:
    """One Engram layer (§2.7, §6.2): the table [rows, W] FP8 bytes + UE8M0 scales
    [rows, ceil(W/32)], wkv [(n-1) heads W, (hc+1) D] ([in, out]), q_weight / k_weight [hc, D]."""
    W, n, D = cfg.engram_head_dim, cfg.hc_mult, cfg.hidden_size
    E = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * W
    return {
        "table": Spec((rows, W), ("engram_rows", None), fp8_codes(), "engram.embed.weight",
                      FP8_CODES, dtype=jnp.uint8),
        "table_scale": Spec((rows, -(-W // 32)), ("engram_rows", None), ue8m0_bytes(),
                            "engram.embed.scale", E8M0, dtype=jnp.uint8),
        "wkv": linear_spec(E, (n + 1) * D, "engram.wkv.weight", FP8, ("engram_in", "engram_kv")),
        "q_weight": Spec((n, D), (None, "norm"), normal(0.1, 1.0), "engram.q_weight", BF16,
                         keep_fp32=True),
        "k_weight": Spec((n, D), (None, "norm"), normal(0.1, 1.0), "engram.k_weight", BF16,
                         keep_fp32=True),
    }


def v41_layer_specs(cfg: ModelConfig, layer: int | None) -> dict[str, Any]:
    """One V4.1 block: mHC pair, block norms, attention with its roles, MoE, and Engram at
    the Engram layers. layer None: a DSpark stage (code 0, no roles)."""
    n = cfg.hc_mult
    specs = {
        "hc_attn": mhc_specs(cfg, "hc_attn", (2 + n) * n),
        "hc_ffn": mhc_specs(cfg, "hc_ffn", (2 + n) * n),
        "attn_norm": norm_spec(cfg.hidden_size, "attn_norm.weight"),
        "ffn_norm": norm_spec(cfg.hidden_size, "ffn_norm.weight"),
        "attn": v41_attention_specs(cfg, layer),
        "ffn": v41_moe_specs(cfg),
    }
    if layer is not None and layer in cfg.engram_layer_ids:
        i = cfg.engram_layer_ids.index(layer)
        specs["engram"] = engram_specs(cfg, cfg.engram_num_embeddings[i])
    return specs


def dspark_stage_config(cfg: ModelConfig) -> ModelConfig:
    """The config of a V4.1 DSpark stage's block: the stage MoE size (§5.1)."""
    return cfg.replace(n_routed_experts=cfg.dspark_n_routed_experts,
                       num_experts_per_tok=cfg.dspark_num_experts_per_tok)


def v41_dspark_specs(cfg: ModelConfig) -> dict[str, Any]:
    """The checkpoint's DSpark drafter (§5.1, §6.2): tapped-feature projection (mtp.0), the
    stages (mtp.0..S-1: code-0 blocks with the stage MoE), final norm, Markov head and
    confidence head (mtp.S-1). Embedding and LM head are the target's. Shapes as stored:
    markov_embed / markov_head [V, r], confidence [1, D + r]."""
    scfg = dspark_stage_config(cfg)
    D, V, r = cfg.hidden_size, cfg.vocab_size, cfg.dspark_markov_rank
    m = len(cfg.dspark_target_layer_ids)
    return {
        "main_proj": linear_spec(m * D, D, "main_proj.weight", FP8, ("tap_embed", "embed")),
        "main_norm": norm_spec(D, "main_norm.weight"),
        "stages": tuple(v41_layer_specs(scfg, None) for _ in range(cfg.num_mtp_layers)),
        "norm": norm_spec(D, "norm.weight"),
        "markov_embed": Spec((V, r), ("vocab", "markov"), normal(1.0),
                             "markov_head.embed.weight", BF16),
        "markov_head": Spec((V, r), ("vocab", "markov"), normal(0.01),
                            "markov_head.head.weight", BF16),
        "confidence": Spec((1, D + r), (None, "confidence_in"), normal(0.01),
                           "confidence_head.proj.weight", BF16),
    }


def v41_param_specs(cfg: ModelConfig, include_mtp: bool = True) -> dict[str, Any]:
    """Every weight of a V4.1 model: no hc_head (the head collapses with the last FFN `pre`,
    §2.9); "mtp" holds the DSpark drafter (`v41_dspark_specs`) or () without one."""
    V, D = cfg.vocab_size, cfg.hidden_size
    return {
        "embed": Spec((V, D), ("vocab", "embed"), normal(1.0), "embed.weight", BF16),
        "layers": LayerStack.from_layers(
            model_layer_groups(cfg),
            [v41_layer_specs(cfg, i) for i in range(cfg.num_hidden_layers)], stack=stack_specs),
        "norm": norm_spec(D, "norm.weight"),
        "head": linear_spec(D, V, "head.weight", BF16, ("embed", "vocab")),
        "mtp": v41_dspark_specs(cfg) if include_mtp and cfg.dspark_block_size else (),
    }


def unstacked_specs(cfg: ModelConfig, include_mtp: bool = True) -> dict[str, Any]:
    """`param_specs` with "layers" a plain tuple of per-layer spec dicts (the init order)."""
    specs = param_specs(cfg, include_mtp)
    return {**specs, "layers": tuple(specs["layers"])}


def param_specs(cfg: ModelConfig, include_mtp: bool = True) -> dict[str, Any]:
    """The abstract description of every weight of the model (same tree as `Params.weights`)."""
    if cfg.is_v41:
        return v41_param_specs(cfg, include_mtp)
    V, D = cfg.vocab_size, cfg.hidden_size
    return {
        "embed": Spec((V, D), ("vocab", "embed"), normal(1.0), "embed.weight", BF16),
        "layers": LayerStack.from_layers(
            layer_groups(cfg), [layer_specs(cfg, lt, mt)
                                for lt, mt in zip(cfg.layer_types, cfg.mlp_layer_types)],
            stack=stack_specs),
        "hc_head": mhc_specs(cfg, "hc_head", cfg.hc_mult),
        "norm": norm_spec(D, "norm.weight"),
        "head": linear_spec(D, V, "head.weight", BF16, ("embed", "vocab")),
        "mtp": tuple(mtp_specs(cfg) for _ in range(cfg.num_mtp_layers if include_mtp else 0)),
    }


def ckpt_prefixes(cfg: ModelConfig, specs: dict[str, Any]) -> dict[str, Any]:
    """Same tree as the specs, each leaf the official name prefix of its block ('layers.3.')."""
    def prefixed(tree, prefix):
        return jax.tree.map(lambda s: prefix, tree, is_leaf=lambda x: isinstance(x, Spec))
    if cfg.is_v41:
        return _v41_ckpt_prefixes(specs, prefixed)
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


def _v41_ckpt_prefixes(specs: dict[str, Any], prefixed) -> dict[str, Any]:
    out = {k: prefixed(specs[k], "") for k in ("embed", "norm", "head")}
    out["layers"] = LayerStack.from_layers(
        specs["layers"].groups, [prefixed(l, f"layers.{i}.") for i, l in enumerate(specs["layers"])],
        stack=lambda xs: StackedPrefix(tuple(xs)))
    mtp = specs["mtp"]
    if not mtp:
        out["mtp"] = mtp
        return out
    last = f"mtp.{len(mtp['stages']) - 1}."
    out["mtp"] = {k: prefixed(v, "mtp.0." if k in ("main_proj", "main_norm") else last)
                  for k, v in mtp.items() if k != "stages"}
    out["mtp"]["stages"] = tuple(prefixed(st, f"mtp.{i}.") for i, st in enumerate(mtp["stages"]))
    return out


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
    values["layers"] = LayerStack.from_layers(model_layer_groups(cfg), values["layers"],
                                              stack=np.stack)
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

    V4.1 (docs/MODEL.md §V1.4) adds: "engram_tables" (table values; "total" excludes them, their
    UE8M0 scales are not parameters), "active_excl_embedding" (the "16B decode") and
    "active_excl_embedding_and_head"; "mtp_*" are the DSpark drafter, "dspark_stage" /
    "dspark_stage_active" one of its stages.
    """
    def count(tree, active: bool, k: int, tables: bool = False):
        total = 0
        for path, s in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_spec)[0]:
            if s.layout == "index" or s.fmt == E8M0 or (s.fmt == FP8_CODES) != tables:
                continue
            size = math.prod(s.shape)
            if active and s.layout == "experts":
                size = size // s.shape[-3] * k
            total += size
        return total

    specs = param_specs(cfg)
    backbone = {k: v for k, v in specs.items() if k != "mtp"}
    k = cfg.num_experts_per_tok
    mtp_k = cfg.dspark_num_experts_per_tok if cfg.is_v41 else k
    out = {
        "total": count(backbone, False, k),
        "active": count(backbone, True, k),
        "mtp_total": count(specs["mtp"], False, mtp_k),
        "mtp_active": count(specs["mtp"], True, mtp_k),
    }
    if cfg.is_v41:
        embed, head = math.prod(specs["embed"].shape), math.prod(specs["head"].shape)
        stage = specs["mtp"]["stages"][0] if specs["mtp"] else {}
        out.update({
            "engram_tables": count(backbone, False, k, tables=True),
            "active_excl_embedding": out["active"] - embed,
            "active_excl_embedding_and_head": out["active"] - embed - head,
            "dspark_stage": count(stage, False, mtp_k),
            "dspark_stage_active": count(stage, True, mtp_k),
        })
    return out
