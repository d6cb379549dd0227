"""Model configuration: one frozen, hashable dataclass (spec/model.md §1).

`ModelConfig` is static metadata of every params pytree, so it must be hashable: every field
is a scalar or a tuple. Presets: "v4-flash" (the official values, §1.1), "mini" (a ~2.5B
model with every attention and MoE type, for GPU benchmarks), "tiny" (CPU tests in seconds).
`ModelConfig.from_hf` reads an HF `config.json` in the official or the transformers spelling.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

from deepinfer_fn.errors import ArgumentTypeError
from deepinfer_fn.validate import describe, is_int, is_number

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
ATTENTION_TYPES = (SWA, CSA, HCA)
HASH_MOE, SCORE_MOE = "hash_moe", "moe"
MLP_TYPES = (HASH_MOE, SCORE_MOE)
NUMERICS_MODES = ("parity", "serving", "batch_invariant")


class ConfigError(ValueError):
    """A config field is unknown, missing, or inconsistent with another."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Every hyper-parameter of a DeepSeek-V4 model; field names follow transformers 5.23."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    csa_ratio: int = 4
    hca_ratio: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2048
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    scoring_func: str = "sqrtsoftplus"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn_factor: float = 16.0
    yarn_original_max_position: int = 65536
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    max_position_embeddings: int = 1048576
    num_mtp_layers: int = 1
    bos_token_id: int = 0
    eos_token_id: int = 1
    fp8_block: tuple[int, int] = (128, 128)
    fp4_group: int = 32
    numerics: str = "parity"
    # Runtime layout, not a model hyper-parameter (never written by `to_hf`): False runs every
    # layer unrolled instead of scanning the repeated layer groups (`layer_groups.py`).
    scan_layers: bool = True

    def __post_init__(self):
        self.validate()

    # ----------------------------------------------------------------------------- checks
    def validate(self) -> None:
        def need(cond: bool, msg: str):
            if not cond:
                raise ConfigError(f"inconsistent ModelConfig: {msg}")

        for f in dataclasses.fields(self):
            problem = _field_type_problem(f.type, getattr(self, f.name))
            if problem:
                raise ConfigError(f"ModelConfig field {f.name} must be {problem}, got "
                                  f"{describe(getattr(self, f.name))}")
        for name in ("hc_eps", "rms_norm_eps", "rope_theta", "compress_rope_theta",
                     "routed_scaling_factor", "swiglu_limit"):
            value = getattr(self, name)
            need(math.isfinite(value) and value > 0,
                 f"{name} must be a finite number > 0, got {value!r}")
        for name in ("yarn_beta_fast", "yarn_beta_slow"):
            value = getattr(self, name)
            need(math.isfinite(value) and value >= 0,
                 f"{name} must be a finite number >= 0, got {value!r}")
        for name in ("yarn_original_max_position", "fp4_group"):
            value = getattr(self, name)
            need(value > 0, f"{name} must be a positive int, got {value!r}")
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            need(0 <= value < self.vocab_size,
                 f"{name}={value} is outside the vocabulary [0, {self.vocab_size})")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window",
                     "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "hc_mult", "hc_sinkhorn_iters", "csa_ratio", "hca_ratio",
                     "index_n_heads", "index_head_dim", "index_topk", "max_position_embeddings"):
            value = getattr(self, name)
            need(isinstance(value, int) and not isinstance(value, bool) and value > 0,
                 f"{name} must be a positive int, got {value!r}")
        need(self.num_mtp_layers >= 0, f"num_mtp_layers must be >= 0, got {self.num_mtp_layers}")
        need(self.n_shared_experts in (0, 1),
             f"n_shared_experts must be 0 or 1, got {self.n_shared_experts}")
        need(len(self.layer_types) == self.num_hidden_layers,
             f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        need(len(self.mlp_layer_types) == self.num_hidden_layers,
             f"mlp_layer_types has {len(self.mlp_layer_types)} entries for "
             f"{self.num_hidden_layers} layers")
        bad = [t for t in self.layer_types if t not in ATTENTION_TYPES]
        need(not bad, f"unknown layer_types {bad}; expected one of {ATTENTION_TYPES}")
        bad = [t for t in self.mlp_layer_types if t not in MLP_TYPES]
        need(not bad, f"unknown mlp_layer_types {bad}; expected one of {MLP_TYPES}")
        need(self.qk_rope_head_dim % 2 == 0 and 0 < self.qk_rope_head_dim <= self.head_dim,
             f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and <= head_dim={self.head_dim}")
        need(self.qk_rope_head_dim <= self.index_head_dim,
             f"qk_rope_head_dim={self.qk_rope_head_dim} must be <= index_head_dim="
             f"{self.index_head_dim} (the indexer rotates its last rope dims)")
        need(self.num_attention_heads % self.o_groups == 0,
             f"num_attention_heads={self.num_attention_heads} not divisible by o_groups={self.o_groups}")
        need(self.num_experts_per_tok <= self.n_routed_experts,
             f"num_experts_per_tok={self.num_experts_per_tok} > n_routed_experts={self.n_routed_experts}")
        need(self.scoring_func == "sqrtsoftplus",
             f"scoring_func={self.scoring_func!r}: only 'sqrtsoftplus' (DeepSeek-V4) is implemented")
        need(self.csa_ratio > 1 and self.hca_ratio > 1, "compression ratios must be > 1")
        need(self.numerics in NUMERICS_MODES,
             f"numerics={self.numerics!r}; expected one of {NUMERICS_MODES}")
        need(len(self.fp8_block) == 2 and all(b > 0 for b in self.fp8_block),
             f"fp8_block must be two positive ints, got {self.fp8_block}")
        need(self.yarn_factor >= 1.0, f"yarn_factor must be >= 1, got {self.yarn_factor}")

    # ----------------------------------------------------------------------------- derived
    def compress_ratio(self, layer: int) -> int:
        """0 for sliding-window layers, else the layer's compression ratio m (§1.3)."""
        return self.compress_ratio_of(self.layer_types[layer])

    def compress_ratio_of(self, layer_type: str) -> int:
        return {SWA: 0, CSA: self.csa_ratio, HCA: self.hca_ratio}[layer_type]

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------------------------- presets
    @classmethod
    def preset(cls, name: str, **overrides) -> "ModelConfig":
        if name not in _PRESETS:
            raise ConfigError(f"unknown preset {name!r}; available: {sorted(_PRESETS)}")
        return dataclasses.replace(_PRESETS[name](), **overrides)

    @staticmethod
    def presets() -> tuple[str, ...]:
        return tuple(sorted(_PRESETS))

    # ----------------------------------------------------------------------------- HF I/O
    @classmethod
    def from_hf(cls, source: str | os.PathLike | Mapping[str, Any], **overrides) -> "ModelConfig":
        """Reads an HF config (a directory, a config.json path, or its dict).

        Accepts the official DeepSeek spelling (`compress_ratios`, `rope_scaling`,
        `num_hash_layers`, `n_routed_experts`, ...) and the transformers 5.x spelling
        (`layer_types`, `compress_rates`, `mlp_layer_types`, `rope_parameters`, ...).
        Unknown fields and inconsistent combinations raise `ConfigError`.
        """
        raw = _read_config_source(source)
        return _config_from_dict(raw, overrides)

    def to_hf(self) -> dict[str, Any]:
        """The official-spelling config.json of this model (what `save_hf` writes)."""
        ratio_code = {SWA: 0, CSA: self.csa_ratio, HCA: self.hca_ratio}
        return {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.sliding_window,
            "layer_types": list(self.layer_types),
            "compress_rates": {CSA: self.csa_ratio, HCA: self.hca_ratio},
            "compress_ratios": [ratio_code[t] for t in self.layer_types] + [0] * self.num_mtp_layers,
            "mlp_layer_types": list(self.mlp_layer_types),
            "compress_rope_theta": self.compress_rope_theta,
            "rope_theta": self.rope_theta,
            "rope_scaling": {"type": "yarn", "factor": self.yarn_factor,
                             "original_max_position_embeddings": self.yarn_original_max_position,
                             "beta_fast": self.yarn_beta_fast, "beta_slow": self.yarn_beta_slow},
            "max_position_embeddings": self.max_position_embeddings,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "scoring_func": self.scoring_func,
            "topk_method": "noaux_tc",
            "norm_topk_prob": True,
            "routed_scaling_factor": self.routed_scaling_factor,
            "swiglu_limit": self.swiglu_limit,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "num_nextn_predict_layers": self.num_mtp_layers,
            "tie_word_embeddings": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }


def _field_type_problem(annotation: str, value) -> str | None:
    """What `value` should be for a field annotated `annotation`, or None if it is that."""
    if annotation == "int":
        return None if is_int(value) else "an int"
    if annotation == "float":
        return None if is_number(value) else "a number"
    if annotation == "str":
        return None if isinstance(value, str) else "a string"
    if annotation == "bool":
        return None if isinstance(value, bool) else "True or False"
    if annotation == "tuple[str, ...]":
        ok = isinstance(value, tuple) and all(isinstance(v, str) for v in value)
        return None if ok else "a list of strings"
    if annotation == "tuple[int, int]":
        ok = isinstance(value, tuple) and len(value) == 2 and all(map(is_int, value))
        return None if ok else "a pair of ints"
    return None


# --------------------------------------------------------------------------------- presets
def _v4_flash() -> ModelConfig:
    n = 43
    layer_types = (SWA, SWA) + tuple(CSA if i % 2 == 0 else HCA for i in range(2, n))
    return ModelConfig(
        vocab_size=129280, hidden_size=4096, num_hidden_layers=n, num_attention_heads=64,
        head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
        sliding_window=128, layer_types=layer_types,
        mlp_layer_types=(HASH_MOE,) * 3 + (SCORE_MOE,) * (n - 3),
        index_n_heads=64, index_head_dim=128, index_topk=512,
        n_routed_experts=256, num_experts_per_tok=6, moe_intermediate_size=2048,
        num_mtp_layers=1,
    )


def _mini() -> ModelConfig:
    # Real head geometry (512-d heads, 64 rope dims, 128-d indexer, window 128, ratios 4/128)
    # so kernels see production shapes; fewer layers, experts and a narrower residual.
    layer_types = (SWA, CSA, HCA, CSA, HCA, CSA, HCA, CSA)
    return ModelConfig(
        vocab_size=129280, hidden_size=2048, num_hidden_layers=8, num_attention_heads=32,
        head_dim=512, qk_rope_head_dim=64, q_lora_rank=768, o_groups=4, o_lora_rank=512,
        sliding_window=128, layer_types=layer_types,
        mlp_layer_types=(HASH_MOE,) * 2 + (SCORE_MOE,) * 6,
        index_n_heads=32, index_head_dim=128, index_topk=512,
        n_routed_experts=64, num_experts_per_tok=6, moe_intermediate_size=512,
        num_mtp_layers=1, numerics="serving",
    )


def _tiny() -> ModelConfig:
    layer_types = (SWA, CSA, HCA, CSA)
    return ModelConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        head_dim=32, qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        sliding_window=8, layer_types=layer_types,
        mlp_layer_types=(HASH_MOE, HASH_MOE, SCORE_MOE, SCORE_MOE), hca_ratio=16,
        index_n_heads=16, index_head_dim=16, index_topk=3,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        yarn_original_max_position=64, max_position_embeddings=1024, num_mtp_layers=1,
    )


_PRESETS = {"v4-flash": _v4_flash, "mini": _mini, "tiny": _tiny}


# --------------------------------------------------------------------------------- from_hf
# Fields that carry no model information (or that we always assume); accepted and ignored.
_IGNORED_KEYS = {
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "use_cache",
    "initializer_range", "pad_token_id", "attention_bias", "attention_dropout", "hidden_act",
    "topk_method", "norm_topk_prob", "output_attentions", "output_hidden_states",
    "return_dict", "tie_word_embeddings", "auto_map", "_name_or_path", "chunk_size_feed_forward",
    "is_encoder_decoder", "problem_type", "id2label", "label2id", "tokenizer_class",
    "quantization_config", "expert_dtype", "num_key_value_heads", "router_aux_loss_coef",
    "output_router_logits", "mlp_bias", "rope_interleave", "pretraining_tp", "max_window_layers",
    "use_sliding_window", "tf_legacy_loss", "use_bfloat16", "_attn_implementation_autoset",
    "attn_implementation", "router_jitter_noise",
}

_RENAMES = {  # official / legacy spelling -> ModelConfig field
    "n_routed_experts": "n_routed_experts",
    "num_local_experts": "n_routed_experts",
    "num_experts": "n_routed_experts",
    "intermediate_size": "moe_intermediate_size",
    "num_nextn_predict_layers": "num_mtp_layers",
}


def _read_config_source(source) -> dict[str, Any]:
    if isinstance(source, Mapping):
        return dict(source)
    if not isinstance(source, (str, os.PathLike)):
        raise ArgumentTypeError(f"ModelConfig.from_hf: source must be a directory, a config.json "
                                f"path or a dict, got {describe(source)}")
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise ConfigError(f"no config.json at {path}")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a JSON object (a dict of fields), got "
                          f"a JSON {type(raw).__name__}")
    return raw


def _checked(key: str, value, kind: str):
    """A number read from config.json: `kind` "int" (not bool) or "float" (ints accepted)."""
    ok = is_int(value) if kind == "int" else is_number(value)
    if not ok:
        raise ConfigError(f"config field {key} must be {'an int' if kind == 'int' else 'a number'}, "
                          f"got {describe(value)}")
    return int(value) if kind == "int" else float(value)


def _checked_dict(key: str, value) -> dict:
    if not isinstance(value, Mapping):
        raise ConfigError(f"config field {key} must be a JSON object, got {describe(value)}")
    return dict(value)


def _checked_list(key: str, value) -> list:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"config field {key} must be a list, got {describe(value)}")
    return list(value)


def _config_from_dict(raw: dict[str, Any], overrides: Mapping[str, Any]) -> ModelConfig:
    raw = dict(raw)
    if "text_config" in raw and isinstance(raw["text_config"], dict):
        raise ConfigError("this config has a text_config (a V4.1 multimodal config); "
                          "V4.1-Flash is not supported by this build")
    if raw.get("model_type", "deepseek_v4") != "deepseek_v4":
        raise ConfigError(f"model_type={raw['model_type']!r}: only 'deepseek_v4' is supported")
    if raw.get("num_key_value_heads", 1) != 1:
        raise ConfigError(f"num_key_value_heads={raw['num_key_value_heads']}: V4 has one shared "
                          "KV head")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    out: dict[str, Any] = {}

    def take(key):
        return raw.pop(key, None)

    n_layers = raw.get("num_hidden_layers")
    if n_layers is None:
        raise ConfigError("config has no num_hidden_layers")
    n_layers = _checked("num_hidden_layers", n_layers, "int")
    if n_layers < 1:
        raise ConfigError(f"config field num_hidden_layers must be a positive int, got {n_layers}")
    for key in ("head_dim", "qk_rope_head_dim"):
        if raw.get(key) is not None:
            _checked(key, raw[key], "int")

    # --- attention schedule: transformers layer_types/compress_rates, or official compress_ratios
    layer_types = take("layer_types")
    compress_rates = take("compress_rates")
    compress_ratios = take("compress_ratios")
    if compress_rates is not None:
        compress_rates = _checked_dict("compress_rates", compress_rates)
        unknown = set(compress_rates) - {CSA, HCA}
        if unknown:
            raise ConfigError(f"compress_rates has unknown layer types {sorted(unknown)}")
        out["csa_ratio"] = _checked(f"compress_rates.{CSA}", compress_rates.get(CSA, 4), "int")
        out["hca_ratio"] = _checked(f"compress_rates.{HCA}", compress_rates.get(HCA, 128), "int")
    if compress_ratios is not None:
        compress_ratios = _checked_list("compress_ratios", compress_ratios)
    if layer_types is not None:
        out["layer_types"] = tuple(_checked_list("layer_types", layer_types))
    elif compress_ratios is not None:
        ratios = list(compress_ratios)
        if len(ratios) < n_layers:
            raise ConfigError(f"compress_ratios has {len(ratios)} entries for {n_layers} layers")
        code = {0: SWA, 4: CSA, 128: HCA}
        if compress_rates is not None:
            code = {0: SWA, out["csa_ratio"]: CSA, out["hca_ratio"]: HCA}
        bad = sorted({r for r in ratios[:n_layers] if r not in code})
        if bad:
            raise ConfigError(f"compress_ratios contains {bad}; only {sorted(code)} are valid "
                              "without explicit layer_types/compress_rates")
        out["layer_types"] = tuple(code[r] for r in ratios[:n_layers])
        extra = [r for r in ratios[n_layers:] if r != 0]
        if extra:
            raise ConfigError(f"compress_ratios entries past the backbone (MTP) must be 0, got {extra}")
    else:
        raise ConfigError("config has neither layer_types nor compress_ratios")
    if compress_ratios is not None and layer_types is not None:
        ratio_of = {SWA: 0, CSA: out.get("csa_ratio", 4), HCA: out.get("hca_ratio", 128)}
        implied = [ratio_of.get(t) for t in out["layer_types"]]
        if list(compress_ratios[:n_layers]) != implied:
            raise ConfigError(f"compress_ratios {compress_ratios[:n_layers]} disagrees with "
                              f"layer_types {list(out['layer_types'])}")

    # --- MLP schedule: transformers mlp_layer_types, or official num_hash_layers
    mlp_types = take("mlp_layer_types")
    num_hash = take("num_hash_layers")
    if num_hash is not None:
        num_hash = _checked("num_hash_layers", num_hash, "int")
    if mlp_types is not None:
        mlp_types = _checked_list("mlp_layer_types", mlp_types)
        out["mlp_layer_types"] = tuple(mlp_types)
        if num_hash is not None and mlp_types.count(HASH_MOE) != num_hash:
            raise ConfigError(f"num_hash_layers={num_hash} disagrees with mlp_layer_types")
    else:
        num_hash = 0 if num_hash is None else num_hash
        if not 0 <= num_hash <= n_layers:
            raise ConfigError(f"num_hash_layers={num_hash} out of range for {n_layers} layers")
        out["mlp_layer_types"] = (HASH_MOE,) * num_hash + (SCORE_MOE,) * (n_layers - num_hash)

    # --- rope: official rope_theta + rope_scaling, or transformers rope_parameters
    rope_parameters = take("rope_parameters")
    rope_scaling = take("rope_scaling")
    partial = take("partial_rotary_factor")
    head_dim = raw.get("head_dim")
    if rope_parameters is not None:
        rope_parameters = _checked_dict("rope_parameters", rope_parameters)
        main = _checked_dict("rope_parameters.main", rope_parameters.get("main", {}))
        comp = _checked_dict("rope_parameters.compress", rope_parameters.get("compress", {}))
        if "rope_theta" in main:
            out["rope_theta"] = _checked("rope_parameters.main.rope_theta", main["rope_theta"],
                                         "float")
        if "rope_theta" in comp:
            out["compress_rope_theta"] = _checked("rope_parameters.compress.rope_theta",
                                                  comp["rope_theta"], "float")
        if comp.get("rope_type", "yarn") == "yarn":
            _take_yarn(comp, out)
        else:
            out["yarn_factor"] = 1.0
        if comp.get("attention_factor", 1.0) not in (1.0, None):
            raise ConfigError(f"compress rope attention_factor={comp['attention_factor']}: "
                              "V4 uses 1.0 (no YaRN mscale)")
        partial = partial or main.get("partial_rotary_factor") or comp.get("partial_rotary_factor")
    if partial is not None:
        partial = _checked("partial_rotary_factor", partial, "float")
    if rope_scaling is not None:
        rope_scaling = _checked_dict("rope_scaling", rope_scaling)
        kind = rope_scaling.get("type", rope_scaling.get("rope_type"))
        if kind != "yarn":
            raise ConfigError(f"rope_scaling type {kind!r}: V4 uses yarn on the compress rope")
        _take_yarn(rope_scaling, out)
    rope_dim = take("qk_rope_head_dim")
    if rope_dim is None and partial is not None and head_dim is not None:
        rope_dim = int(round(head_dim * partial))
    if rope_dim is not None:
        out["qk_rope_head_dim"] = int(rope_dim)
        if partial is not None and head_dim is not None and int(round(head_dim * partial)) != rope_dim:
            raise ConfigError(f"qk_rope_head_dim={rope_dim} disagrees with partial_rotary_factor="
                              f"{partial} x head_dim={head_dim}")

    # --- the rest, with aliases
    for key in list(raw):
        value = raw.pop(key)
        if key in _IGNORED_KEYS:
            continue
        if key == "dspark_num_stages" or key.startswith("dspark_"):
            raise ConfigError(f"config field {key!r}: DSpark checkpoints (V4-Flash-0731) are not "
                              "supported by this build")
        name = _RENAMES.get(key, key)
        if name not in fields:
            raise ConfigError(f"unknown config field {key!r}")
        if name == "eos_token_id" and isinstance(value, list) and value:
            value = value[0]
        out[name] = tuple(value) if isinstance(value, list) else value
    out.update(overrides)
    try:
        return ModelConfig(**out)
    except TypeError as e:
        raise ConfigError(f"config is missing fields: {e}") from e


def _take_yarn(d: Mapping[str, Any], out: dict[str, Any]) -> None:
    known = {"type", "rope_type", "factor", "original_max_position_embeddings", "beta_fast",
             "beta_slow", "rope_theta", "partial_rotary_factor", "attention_factor", "mscale",
             "mscale_all_dim", "truncate"}
    unknown = set(d) - known
    if unknown:
        raise ConfigError(f"unknown rope fields {sorted(unknown)}")
    if "factor" in d:
        out["yarn_factor"] = _checked("rope factor", d["factor"], "float")
    if "original_max_position_embeddings" in d:
        out["yarn_original_max_position"] = _checked(
            "rope original_max_position_embeddings", d["original_max_position_embeddings"], "int")
    if "beta_fast" in d:
        out["yarn_beta_fast"] = _checked("rope beta_fast", d["beta_fast"], "float")
    if "beta_slow" in d:
        out["yarn_beta_slow"] = _checked("rope beta_slow", d["beta_slow"], "float")
    for key in ("mscale", "mscale_all_dim"):
        if d.get(key) not in (None, 0, 1, 0.0, 1.0):
            raise ConfigError(f"rope {key}={d[key]}: V4 applies no YaRN amplitude scaling")
