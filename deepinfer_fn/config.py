"""Model configuration: one frozen, hashable dataclass (docs/MODEL.md §1, docs/MODEL.md §V1).

`ModelConfig` is static metadata of every params pytree, so it must be hashable: every field
is a scalar or a tuple. Presets: "v4-flash" (the official values, §1.1), "mini" (a ~2.5B
model with every attention and MoE type, for GPU benchmarks), "tiny" (CPU tests in seconds);
DeepSeek-V4.1 (`model_type="deepseek_v41"`): "v4.1-flash" (official values), "v4.1-mini"
(every V4.1 mechanism, one H200 in bf16 with its Engram tables), "v4.1-tiny" (CPU tests).
`ModelConfig.from_hf` reads an HF `config.json`: V4 in the official or the transformers
spelling, V4.1 in the official nested layout (`text_config`, `vision_config`,
`quantization_config`) or SGLang's flattened one.

V4.1 layers: `layer_types` holds the attention code of each layer (SWA = 0, PAIR = 2: one
latent per pair of tokens, TOKEN = 1: one latent per token); the roles (kv source, index
source, candidate publisher / consumer, Engram) come from the `*_layer_ids` fields and the
`kv_source_of` / `index_source_of` / `candidate_role` / `layer_kinds` helpers (§1.3).
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
PAIR, TOKEN = "pair_sparse_attention", "token_sparse_attention"     # V4.1 codes 2 and 1
V41_ATTENTION_TYPES = (SWA, PAIR, TOKEN)
V41_CODES = {SWA: 0, PAIR: 2, TOKEN: 1}
V4, V41 = "deepseek_v4", "deepseek_v41"
MODEL_TYPES = (V4, V41)
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
    # ---- DeepSeek-V4.1 (docs/MODEL.md §V1.1); the defaults are V4's (V4 configs never
    # set the V4.1-only fields, `V41_ONLY_FIELDS`).
    model_type: str = V4
    hc_pre_from_prev_sublayer: bool = False      # lagged mHC collapse (§2.1); V4.1: True
    q_head_norm: bool = True                     # per-head query RMSNorm (§2.2); V4.1: False
    kv_source_layer_ids: tuple[int, ...] = ()    # layers owning a compressor + index keys
    index_source_layer_ids: tuple[int, ...] = ()  # layers computing a top-k selection
    candidate_source_layer_id: int = -1          # publishes candidate blocks (§2.5); -1 none
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    engram_layer_ids: tuple[int, ...] = ()       # Engram before these layers (§2.7)
    engram_num_embeddings: tuple[int, ...] = ()  # table rows per Engram layer (sum of primes)
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000            # the table moduli are the primes above this
    engram_n_heads: int = 8                      # hash heads per n-gram size
    engram_head_dim: int = 256                   # values per table row
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 99092    # distinct keys of the token map
    pad_token_id: int = -1
    image_token_id: int = -1                     # Engram blocking and `bias_vl` routing
    dspark_block_size: int = 0                   # γ; 0: no DSpark stages (§5)
    dspark_noise_token_id: int = -1
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 0
    dspark_n_routed_experts: int = 0
    dspark_num_experts_per_tok: int = 0
    vision_num_hidden_layers: int = 0            # 0: no vision tower (§1.1 vision_config)
    vision_hidden_size: int = 0
    vision_num_attention_heads: int = 0
    vision_intermediate_size: int = 0
    vision_patch_size: int = 0
    vision_rope_theta: float = 10000.0
    vision_downsample_ratio: int = 0
    vision_max_image_tokens: int = 0
    vision_min_pixels: int = 0
    vision_max_wh_ratio: float = 0.0             # 0: no limit (null in config.json)
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
        need(self.model_type in MODEL_TYPES,
             f"model_type={self.model_type!r}; expected one of {MODEL_TYPES}")
        allowed = V41_ATTENTION_TYPES if self.model_type == V41 else ATTENTION_TYPES
        bad = [t for t in self.layer_types if t not in allowed]
        need(not bad, f"unknown layer_types {bad} for model_type {self.model_type!r}; expected "
                      f"one of {allowed}")
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
        if self.model_type == V41:
            _validate_v41(self, need)
        else:
            for name in V41_ONLY_FIELDS:
                need(getattr(self, name) == _DEFAULTS[name],
                     f"{name}={getattr(self, name)!r} is a DeepSeek-V4.1 field; set "
                     f"model_type={V41!r} or leave it at {_DEFAULTS[name]!r}")

    # ----------------------------------------------------------------------------- derived
    def compress_ratio(self, layer: int) -> int:
        """0 for sliding-window layers, else the layer's compression ratio m (§1.3)."""
        return self.compress_ratio_of(self.layer_types[layer])

    def compress_ratio_of(self, layer_type: str) -> int:
        """V4: the ratio m; V4.1: the code (group size 2 or 1); 0 for sliding window."""
        return {SWA: 0, CSA: self.csa_ratio, HCA: self.hca_ratio, PAIR: 2, TOKEN: 1}[layer_type]

    @property
    def is_v41(self) -> bool:
        return self.model_type == V41

    def kv_source_of(self, layer: int) -> int | None:
        """V4.1 §1.3: the kv source whose latents / index keys `layer` attends to (the largest
        kv source <= layer with the same code); None for code-0 layers (and for V4)."""
        return _nearest_source(self, self.kv_source_layer_ids, layer)

    def index_source_of(self, layer: int) -> int | None:
        """V4.1 §1.3: the index source whose top-k selection `layer` uses."""
        return _nearest_source(self, self.index_source_layer_ids, layer)

    def candidate_role(self, layer: int) -> str:
        """V4.1 §2.5: "publish" (the candidate source), "consume" (a later index source of
        the same code reading the same kv source, not itself a kv source) or ""."""
        c = self.candidate_source_layer_id
        if c < 0 or not self.is_v41:
            return ""
        if layer == c:
            return "publish"
        if (layer > c and layer in self.index_source_layer_ids
                and layer not in self.kv_source_layer_ids
                and self.compress_ratio(layer) == self.compress_ratio(c)
                and self.kv_source_of(layer) == self.kv_source_of(c)):
            return "consume"
        return ""

    def layer_kind(self, layer: int) -> tuple[str, str]:
        """(attention kind, mlp kind): equal kinds have the same weights and the same forward
        code. V4: (layer type, mlp type). V4.1: the layer type with its roles appended
        ("+kv_source", "+index_source", "+candidate_publish" / "+candidate_consume",
        "+engram")."""
        lt, mt = self.layer_types[layer], self.mlp_layer_types[layer]
        if not self.is_v41:
            return lt, mt
        roles = [r for r, on in (("kv_source", layer in self.kv_source_layer_ids),
                                 ("index_source", layer in self.index_source_layer_ids))
                 if on]
        if self.candidate_role(layer):
            roles.append(f"candidate_{self.candidate_role(layer)}")
        if layer in self.engram_layer_ids:
            roles.append("engram")
        return "+".join([lt] + roles), mt

    def layer_kinds(self) -> tuple[tuple[str, str], ...]:
        return tuple(self.layer_kind(i) for i in range(self.num_hidden_layers))

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
        """The official-spelling config.json of this model (what `save_hf` writes); V4.1: the
        official nested layout (`text_config`, `vision_config`, `quantization_config`)."""
        if self.is_v41:
            return _v41_to_hf(self)
        ratio_code = {SWA: 0, CSA: self.csa_ratio, HCA: self.hca_ratio}
        out = {
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
        for name in ("hc_pre_from_prev_sublayer", "q_head_norm"):   # only when not V4's
            if getattr(self, name) != _DEFAULTS[name]:
                out[name] = getattr(self, name)
        return out


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
    if annotation == "tuple[int, ...]":
        ok = isinstance(value, tuple) and all(map(is_int, value))
        return None if ok else "a list of ints"
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


def _code_types(codes) -> tuple[str, ...]:
    by_code = {c: t for t, c in V41_CODES.items()}
    return tuple(by_code[c] for c in codes)


def _v41_engram_rows(vocab: int, layers: int, heads: int, ngram: int) -> tuple[int, ...]:
    from deepinfer_fn.model.engram import table_rows
    return table_rows(vocab, layers, heads, ngram)


def _v41_flash() -> ModelConfig:
    n = 40
    return ModelConfig(
        vocab_size=129280, hidden_size=5120, num_hidden_layers=n, num_attention_heads=64,
        head_dim=512, qk_rope_head_dim=64, q_lora_rank=1280, o_groups=8, o_lora_rank=1024,
        sliding_window=128, layer_types=_code_types([0, 0] + [2] * 18 + [1] * 20),
        mlp_layer_types=(SCORE_MOE,) * n,
        index_n_heads=32, index_head_dim=128, index_topk=512,
        n_routed_experts=384, num_experts_per_tok=6, moe_intermediate_size=2304,
        rms_norm_eps=1e-20, num_mtp_layers=3, fp8_block=(32, 32),
        model_type=V41, hc_pre_from_prev_sublayer=True, q_head_norm=False,
        kv_source_layer_ids=(2, 8, 14, 20), index_source_layer_ids=(2, 8, 14, 20, 24, 28, 32, 36),
        candidate_source_layer_id=20, candidate_topk_blocks=2048, candidate_block_size=8,
        engram_layer_ids=(1, 14), engram_num_embeddings=(384006168, 384016682),
        engram_max_ngram_size=4, engram_vocab_size=16000000, engram_n_heads=8,
        engram_head_dim=256, engram_pad_token_id=2, engram_compressed_vocab_size=99092,
        pad_token_id=2, image_token_id=129264,
        dspark_block_size=5, dspark_noise_token_id=128799, dspark_target_layer_ids=(37, 38, 39),
        dspark_markov_rank=256, dspark_n_routed_experts=128, dspark_num_experts_per_tok=3,
        vision_num_hidden_layers=32, vision_hidden_size=1024, vision_num_attention_heads=16,
        vision_intermediate_size=2816, vision_patch_size=14, vision_rope_theta=10000.0,
        vision_downsample_ratio=3, vision_max_image_tokens=1024, vision_min_pixels=295936,
        vision_max_wh_ratio=0.0,
    )


def _v41_mini() -> ModelConfig:
    # Real head, indexer, window and Engram row geometry and the real vocabulary (so the token
    # map is the real one); 12 layers with every role: code-0 (+Engram), code-2 sources
    # (one with Engram) and readers, the code-1 source publishing candidate blocks (256 of 8
    # rows, so the prefilter bites above 2k tokens), consumers and readers; 3 DSpark stages.
    n = 12
    return ModelConfig(
        vocab_size=129280, hidden_size=2048, num_hidden_layers=n, num_attention_heads=32,
        head_dim=512, qk_rope_head_dim=64, q_lora_rank=768, o_groups=4, o_lora_rank=512,
        sliding_window=128, layer_types=_code_types([0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1]),
        mlp_layer_types=(SCORE_MOE,) * n,
        index_n_heads=32, index_head_dim=128, index_topk=512,
        n_routed_experts=64, num_experts_per_tok=6, moe_intermediate_size=512,
        rms_norm_eps=1e-20, num_mtp_layers=3, fp8_block=(32, 32), numerics="serving",
        model_type=V41, hc_pre_from_prev_sublayer=True, q_head_norm=False,
        kv_source_layer_ids=(2, 4, 6), index_source_layer_ids=(2, 4, 6, 8, 10),
        candidate_source_layer_id=6, candidate_topk_blocks=256, candidate_block_size=8,
        engram_layer_ids=(1, 4), engram_num_embeddings=_v41_engram_rows(500000, 2, 8, 4),
        engram_max_ngram_size=4, engram_vocab_size=500000, engram_n_heads=8,
        engram_head_dim=256, engram_pad_token_id=2, engram_compressed_vocab_size=99092,
        pad_token_id=2, image_token_id=129264,
        dspark_block_size=5, dspark_noise_token_id=128799, dspark_target_layer_ids=(9, 10, 11),
        dspark_markov_rank=256, dspark_n_routed_experts=16, dspark_num_experts_per_tok=3,
    )


def _v41_tiny() -> ModelConfig:
    # Codes [0, 0, 2, 2, 1, 1, 1, 1]: kv sources 2 (pairs) and 4 (tokens, candidate source,
    # blocks of 2, 2 kept: the prefilter bites above 4 rows), consumer 6, Engram before 1 and
    # 2 (2 scale blocks per row); identity token map (compressed vocabulary = vocabulary).
    n = 8
    return ModelConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=n, num_attention_heads=4,
        head_dim=32, qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        sliding_window=8, layer_types=_code_types([0, 0, 2, 2, 1, 1, 1, 1]),
        mlp_layer_types=(SCORE_MOE,) * n,
        index_n_heads=4, index_head_dim=16, index_topk=3,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        yarn_original_max_position=64, max_position_embeddings=1024,
        rms_norm_eps=1e-20, num_mtp_layers=3, fp8_block=(32, 32),
        model_type=V41, hc_pre_from_prev_sublayer=True, q_head_norm=False,
        kv_source_layer_ids=(2, 4), index_source_layer_ids=(2, 4, 6),
        candidate_source_layer_id=4, candidate_topk_blocks=2, candidate_block_size=2,
        engram_layer_ids=(1, 2), engram_num_embeddings=_v41_engram_rows(100, 2, 2, 4),
        engram_max_ngram_size=4, engram_vocab_size=100, engram_n_heads=2,
        engram_head_dim=64, engram_pad_token_id=2, engram_compressed_vocab_size=256,
        pad_token_id=2, image_token_id=250,
        dspark_block_size=5, dspark_noise_token_id=251, dspark_target_layer_ids=(5, 6, 7),
        dspark_markov_rank=8, dspark_n_routed_experts=4, dspark_num_experts_per_tok=2,
    )


_PRESETS = {"v4-flash": _v4_flash, "mini": _mini, "tiny": _tiny,
            "v4.1-flash": _v41_flash, "v4.1-mini": _v41_mini, "v4.1-tiny": _v41_tiny}


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
    if "text_config" in raw or raw.get("model_type") in _V41_MODEL_TYPES:
        return _v41_from_dict(raw, overrides)
    if raw.get("model_type", V4) != V4:
        raise ConfigError(f"model_type={raw['model_type']!r}: only {V4!r} and {V41!r} (with "
                          f"its text_config) are supported")
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


# --------------------------------------------------------------------------------- V4.1
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)
             if f.default is not dataclasses.MISSING}
# Fields a V4 config leaves at their defaults (the two mHC / query-norm flags are allowed on V4
# for ablations; everything else here only means something for model_type deepseek_v41).
V41_ONLY_FIELDS = tuple(
    name for name in _DEFAULTS
    if name.startswith(("kv_source", "index_source", "candidate_", "engram_", "dspark_",
                        "vision_")) or name in ("pad_token_id", "image_token_id"))

_V41_MODEL_TYPES = (V41, "deepseek_v41_text")
_V41_TOP_KEYS = {  # the top level of the official nested config.json
    "architectures", "model_type", "dtype", "torch_dtype", "transformers_version", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "image_token_id", "text_config",
    "vision_config", "quantization_config", "expert_dtype", "tie_word_embeddings",
    "_name_or_path",
}
_V41_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "image_token_id")
# text_config fields with one value this implementation supports: checked, then dropped.
_V41_FIXED = {"topk_method": "noaux_tc", "norm_topk_prob": True, "hidden_act": "silu",
              "attention_bias": False, "tie_word_embeddings": False}
_V41_TEXT_IGNORED = {"dtype", "torch_dtype", "transformers_version", "use_cache",
                     "initializer_range", "attention_dropout", "architectures", "_name_or_path"}
# ModelConfig fields that config.json never spells directly in a V4.1 text_config.
_V41_NOT_TEXT = {"layer_types", "mlp_layer_types", "csa_ratio", "hca_ratio", "fp8_block",
                 "fp4_group", "numerics", "scan_layers", "model_type", "num_mtp_layers",
                 "yarn_factor", "yarn_original_max_position", "yarn_beta_fast", "yarn_beta_slow"}
_VISION_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                "patch_size", "rope_theta", "downsample_ratio", "max_image_tokens", "min_pixels",
                "max_wh_ratio")
_SGLANG_VISION = {"vision_n_layers": "num_hidden_layers", "vision_dim": "hidden_size"}
_V41_QUANT = {"quant_method": "fp8", "activation_scheme": "dynamic", "scale_fmt": "ue8m0",
              "fmt": "e4m3", "expert_dtype": "fp4"}


def _nearest_source(cfg: ModelConfig, sources: tuple[int, ...], layer: int) -> int | None:
    code = cfg.compress_ratio(layer)
    if not cfg.is_v41 or code == 0:
        return None
    found = [s for s in sources if s <= layer and cfg.compress_ratio(s) == code]
    return max(found) if found else None


def _validate_v41(c: ModelConfig, need) -> None:
    """The V4.1 consistency rules (docs/MODEL.md §V1.1-§1.3, §2.7, §5)."""
    L, V = c.num_hidden_layers, c.vocab_size
    need(all(t == SCORE_MOE for t in c.mlp_layer_types),
         f"DeepSeek-V4.1 has no hash-routed layers; mlp_layer_types must all be {SCORE_MOE!r}")
    for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids",
                 "dspark_target_layer_ids"):
        ids = list(getattr(c, name))
        need(ids == sorted(set(ids)), f"{name}={ids} must be increasing without repeats")
        need(all(0 <= i < L for i in ids), f"{name}={ids} names layers outside 0..{L - 1}")
    for name in ("kv_source_layer_ids", "index_source_layer_ids"):
        bad = [i for i in getattr(c, name) if c.compress_ratio(i) == 0]
        need(not bad, f"{name} {bad} are sliding-window (code 0) layers")
    bad = [i for i in c.kv_source_layer_ids if i not in c.index_source_layer_ids]
    need(not bad, f"kv sources {bad} are not in index_source_layer_ids (a kv source scores its "
                  f"own index keys)")
    bad = [i for i in range(L) if c.compress_ratio(i) and c.kv_source_of(i) is None]
    need(not bad, f"layers {bad} have a compressed code but no kv source of that code at or "
                  f"before them (kv_source_layer_ids={list(c.kv_source_layer_ids)})")
    cand = c.candidate_source_layer_id
    need(cand == -1 or cand in c.index_source_layer_ids,
         f"candidate_source_layer_id={cand} must be -1 or an index source "
         f"{list(c.index_source_layer_ids)}")
    for name in ("candidate_topk_blocks", "candidate_block_size", "engram_n_heads",
                 "engram_head_dim", "engram_vocab_size", "engram_compressed_vocab_size"):
        need(getattr(c, name) > 0, f"{name} must be a positive int, got {getattr(c, name)}")
    need(c.engram_max_ngram_size >= 2,
         f"engram_max_ngram_size must be >= 2, got {c.engram_max_ngram_size}")
    need(c.engram_compressed_vocab_size <= V,
         f"engram_compressed_vocab_size={c.engram_compressed_vocab_size} > vocab_size={V}")
    need(0 <= c.engram_pad_token_id < V,
         f"engram_pad_token_id={c.engram_pad_token_id} is outside the vocabulary [0, {V})")
    for name in ("pad_token_id", "image_token_id"):
        value = getattr(c, name)
        need(value == -1 or 0 <= value < V,
             f"{name}={value} must be -1 (none) or inside the vocabulary [0, {V})")
    if c.engram_layer_ids:
        from deepinfer_fn.model.engram import MAX_MODULUS, table_primes
        primes = table_primes(c.engram_vocab_size, len(c.engram_layer_ids), c.engram_n_heads,
                              c.engram_max_ngram_size)
        need(max(max(p) for p in primes) < MAX_MODULUS,
             f"engram_vocab_size={c.engram_vocab_size}: the table moduli must stay below "
             f"2^28 (the device hash's limit)")
        rows = tuple(sum(p) for p in primes)
        need(c.engram_num_embeddings == rows,
             f"engram_num_embeddings={list(c.engram_num_embeddings)} disagrees with the prime "
             f"layout of engram_vocab_size={c.engram_vocab_size}, engram_n_heads="
             f"{c.engram_n_heads}, engram_max_ngram_size={c.engram_max_ngram_size} over "
             f"{len(c.engram_layer_ids)} layers, which gives {list(rows)}")
    else:
        need(not c.engram_num_embeddings,
             f"engram_num_embeddings={list(c.engram_num_embeddings)} without engram_layer_ids")
    if c.dspark_block_size:
        need(c.dspark_block_size > 0, f"dspark_block_size must be >= 0, got {c.dspark_block_size}")
        need(c.num_mtp_layers >= 1, "DSpark needs num_nextn_predict_layers >= 1 stages")
        need(0 <= c.dspark_noise_token_id < V,
             f"dspark_noise_token_id={c.dspark_noise_token_id} is outside the vocabulary")
        need(bool(c.dspark_target_layer_ids), "dspark_target_layer_ids is empty")
        need(c.dspark_markov_rank > 0,
             f"dspark_markov_rank must be a positive int, got {c.dspark_markov_rank}")
        need(1 <= c.dspark_num_experts_per_tok <= c.dspark_n_routed_experts,
             f"dspark_num_experts_per_tok={c.dspark_num_experts_per_tok} must be in 1.."
             f"dspark_n_routed_experts={c.dspark_n_routed_experts}")
    else:
        need(c.num_mtp_layers == 0,
             f"num_nextn_predict_layers={c.num_mtp_layers}: V4.1's next-n layers are DSpark "
             f"stages, which need dspark_block_size and the other dspark_* fields")
        bad = [n for n in V41_ONLY_FIELDS if n.startswith("dspark_")
               and getattr(c, n) != _DEFAULTS[n]]
        need(not bad, f"{bad} set without dspark_block_size")
    vision = [n for n in V41_ONLY_FIELDS if n.startswith("vision_")]
    if c.vision_num_hidden_layers:
        for name in vision:
            need(getattr(c, name) > 0 or name == "vision_max_wh_ratio",
                 f"{name} must be positive with a vision tower, got {getattr(c, name)!r}")
        need(c.vision_hidden_size % c.vision_num_attention_heads == 0,
             f"vision_hidden_size={c.vision_hidden_size} not divisible by "
             f"vision_num_attention_heads={c.vision_num_attention_heads}")
        need(c.vision_max_wh_ratio >= 0, f"vision_max_wh_ratio must be >= 0 (0: none), got "
                                         f"{c.vision_max_wh_ratio}")
    else:
        bad = [n for n in vision if getattr(c, n) != _DEFAULTS[n]]
        need(not bad, f"{bad} set without vision_num_hidden_layers")


def _v41_to_hf(c: ModelConfig) -> dict[str, Any]:
    codes = [V41_CODES[t] for t in c.layer_types] + [0] * c.num_mtp_layers
    text = {
        "model_type": "deepseek_v41_text",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": 1, "head_dim": c.head_dim, "qk_rope_head_dim": c.qk_rope_head_dim,
        "q_lora_rank": c.q_lora_rank, "o_groups": c.o_groups, "o_lora_rank": c.o_lora_rank,
        "sliding_window": c.sliding_window, "compress_ratios": codes,
        "compress_rope_theta": c.compress_rope_theta, "rope_theta": c.rope_theta,
        "rope_scaling": {"rope_type": "yarn", "factor": c.yarn_factor,
                         "beta_fast": c.yarn_beta_fast, "beta_slow": c.yarn_beta_slow,
                         "original_max_position_embeddings": c.yarn_original_max_position},
        "max_position_embeddings": c.max_position_embeddings,
        "kv_source_layer_ids": list(c.kv_source_layer_ids),
        "index_source_layer_ids": list(c.index_source_layer_ids),
        "index_n_heads": c.index_n_heads, "index_head_dim": c.index_head_dim,
        "index_topk": c.index_topk,
        "candidate_source_layer_id": c.candidate_source_layer_id,
        "candidate_topk_blocks": c.candidate_topk_blocks,
        "candidate_block_size": c.candidate_block_size,
        "hc_mult": c.hc_mult, "hc_sinkhorn_iters": c.hc_sinkhorn_iters, "hc_eps": c.hc_eps,
        "engram_layer_ids": list(c.engram_layer_ids),
        "engram_num_embeddings": list(c.engram_num_embeddings),
        "engram_max_ngram_size": c.engram_max_ngram_size,
        "engram_vocab_size": c.engram_vocab_size, "engram_n_heads": c.engram_n_heads,
        "engram_head_dim": c.engram_head_dim, "engram_pad_token_id": c.engram_pad_token_id,
        "engram_compressed_vocab_size": c.engram_compressed_vocab_size,
        "n_routed_experts": c.n_routed_experts, "n_shared_experts": c.n_shared_experts,
        "num_experts_per_tok": c.num_experts_per_tok,
        "moe_intermediate_size": c.moe_intermediate_size, "scoring_func": c.scoring_func,
        **{k: v for k, v in _V41_FIXED.items() if k != "tie_word_embeddings"},
        "routed_scaling_factor": c.routed_scaling_factor, "swiglu_limit": c.swiglu_limit,
        "rms_norm_eps": c.rms_norm_eps, "num_nextn_predict_layers": c.num_mtp_layers,
    }
    if c.dspark_block_size:
        text.update({name: (list(getattr(c, name)) if isinstance(getattr(c, name), tuple)
                            else getattr(c, name))
                     for name in V41_ONLY_FIELDS if name.startswith("dspark_")})
    for name, v41 in (("hc_pre_from_prev_sublayer", True), ("q_head_norm", False)):
        if getattr(c, name) != v41:             # implicit in the official config.json
            text[name] = getattr(c, name)
    out: dict[str, Any] = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": V41,
                           "dtype": "bfloat16", "bos_token_id": c.bos_token_id,
                           "eos_token_id": c.eos_token_id}
    for name in ("pad_token_id", "image_token_id"):
        if getattr(c, name) >= 0:
            out[name] = getattr(c, name)
    out["text_config"] = text
    if c.vision_num_hidden_layers:
        out["vision_config"] = {k: getattr(c, f"vision_{k}") for k in _VISION_KEYS}
        if not c.vision_max_wh_ratio:
            out["vision_config"]["max_wh_ratio"] = None
    out["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": list(c.fp8_block), "scale_fmt": "ue8m0",
                                  "expert_dtype": "fp4"}
    return out


def _v41_from_dict(raw: dict[str, Any], overrides: Mapping[str, Any]) -> ModelConfig:
    """A V4.1 config.json: official nested (text_config / vision_config / quantization_config)
    or SGLang's flattened spelling (text fields at the top, vision fields prefixed vision_)."""
    raw = dict(raw)
    model_type = raw.get("model_type", V41)
    if model_type not in _V41_MODEL_TYPES:
        raise ConfigError(f"model_type={model_type!r} with a text_config: expected {V41!r}")
    if "text_config" in raw:
        text = _checked_dict("text_config", raw.pop("text_config"))
        vision = raw.pop("vision_config", None)
        unknown = sorted(k for k in raw if k not in _V41_TOP_KEYS)
        if unknown:
            raise ConfigError(f"unknown config field {unknown[0]!r} at the top level of a V4.1 "
                              f"config (model fields belong in text_config)")
        top = raw
    else:
        top = {k: raw.pop(k) for k in list(raw) if k in _V41_TOP_KEYS}
        vision = _sglang_vision(raw)
        text = raw
    out = _v41_text_fields(text)
    for key in _V41_TOKEN_KEYS:
        if key in top:
            value = top[key]
            if key == "eos_token_id" and isinstance(value, list) and value:
                value = value[0]
            value = _checked(key, value, "int")
            if key in out and out[key] != value:
                raise ConfigError(f"config field {key} is {value} at the top level but "
                                  f"{out[key]} in text_config")
            out[key] = value
    if vision is not None:
        out.update(_v41_vision_fields(vision))
    out.update(_v41_quant_fields(top.get("quantization_config"), top.get("expert_dtype")))
    out["model_type"] = V41
    out.setdefault("hc_pre_from_prev_sublayer", True)
    out.setdefault("q_head_norm", False)
    out.update(overrides)
    try:
        return ModelConfig(**out)
    except TypeError as e:
        raise ConfigError(f"config is missing fields: {e}") from e


def _sglang_vision(flat: dict[str, Any]) -> dict[str, Any] | None:
    """Pops SGLang's vision_* fields from a flattened config into vision_config spelling."""
    vision: dict[str, Any] = {}
    for key in [k for k in flat if k.startswith("vision_")]:
        name = _SGLANG_VISION.get(key, key[len("vision_"):])
        value = flat.pop(key)
        if name in vision and vision[name] != value:
            raise ConfigError(f"config field {key}={value!r} disagrees with another spelling "
                              f"of vision {name} ({vision[name]!r})")
        vision[name] = value
    return vision or None


def _v41_text_fields(text: Mapping[str, Any]) -> dict[str, Any]:
    """ModelConfig keyword arguments from a V4.1 text_config (or a flattened config)."""
    t = dict(text)
    model_type = t.pop("model_type", None)
    if model_type not in (None,) + _V41_MODEL_TYPES:
        raise ConfigError(f"text_config model_type={model_type!r}: expected "
                          f"'deepseek_v41_text'")
    if "num_hidden_layers" not in t:
        raise ConfigError("config has no num_hidden_layers")
    n_layers = _checked("num_hidden_layers", t.pop("num_hidden_layers"), "int")
    if n_layers < 1:
        raise ConfigError(f"config field num_hidden_layers must be a positive int, got {n_layers}")
    nextn = _checked("num_nextn_predict_layers", t.pop("num_nextn_predict_layers", 0), "int")
    if nextn < 0:
        raise ConfigError(f"config field num_nextn_predict_layers must be >= 0, got {nextn}")
    out: dict[str, Any] = {"num_hidden_layers": n_layers, "num_mtp_layers": nextn,
                           "mlp_layer_types": (SCORE_MOE,) * n_layers, "fp8_block": (32, 32)}
    if t.get("num_key_value_heads", 1) != 1:
        raise ConfigError(f"num_key_value_heads={t['num_key_value_heads']}: V4.1 has one shared "
                          "KV head")
    t.pop("num_key_value_heads", None)
    num_hash = t.pop("num_hash_layers", None)
    if num_hash not in (None, 0):
        raise ConfigError(f"num_hash_layers={num_hash!r}: DeepSeek-V4.1 has no hash-routed layers")
    if "compress_ratios" not in t:
        raise ConfigError("config has no compress_ratios (the V4.1 attention code per layer)")
    codes = _checked_list("compress_ratios", t.pop("compress_ratios"))
    if len(codes) != n_layers + nextn:
        raise ConfigError(f"compress_ratios has {len(codes)} entries; expected num_hidden_layers "
                          f"+ num_nextn_predict_layers = {n_layers} + {nextn}")
    codes = [_checked(f"compress_ratios[{i}]", v, "int") for i, v in enumerate(codes)]
    by_code = {c: lt for lt, c in V41_CODES.items()}
    bad = sorted({v for v in codes[:n_layers] if v not in by_code})
    if bad:
        raise ConfigError(f"compress_ratios contains {bad}; V4.1 codes are 0 (window), 1 (per "
                          f"token) and 2 (pairs)")
    if any(codes[n_layers:]):
        raise ConfigError(f"compress_ratios entries of the DSpark stages must be 0, got "
                          f"{codes[n_layers:]}")
    out["layer_types"] = tuple(by_code[v] for v in codes[:n_layers])
    rope_scaling = t.pop("rope_scaling", None)
    if rope_scaling is not None:
        rope_scaling = _checked_dict("rope_scaling", rope_scaling)
        kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
        if kind != "yarn":
            raise ConfigError(f"rope_scaling type {kind!r}: V4.1 uses yarn on the compress rope")
        _take_yarn(rope_scaling, out)
    for key, want in _V41_FIXED.items():
        if key in t and t.pop(key) != want:
            raise ConfigError(f"config field {key}={text[key]!r}: only {want!r} is supported")
    fields = {f.name for f in dataclasses.fields(ModelConfig)} - _V41_NOT_TEXT
    for key, value in t.items():
        if key in _V41_TEXT_IGNORED:
            continue
        name = _RENAMES.get(key, key)
        if name not in fields or name.startswith("vision_"):
            raise ConfigError(f"unknown config field {key!r} in a V4.1 text_config")
        if name == "eos_token_id" and isinstance(value, list) and value:
            value = value[0]
        out[name] = tuple(value) if isinstance(value, list) else value
    return out


def _v41_vision_fields(vision) -> dict[str, Any]:
    v = _checked_dict("vision_config", vision)
    v.pop("model_type", None)
    out = {}
    for key, value in v.items():
        if key not in _VISION_KEYS:
            raise ConfigError(f"unknown vision_config field {key!r}; known: {list(_VISION_KEYS)}")
        if key == "max_wh_ratio" and value is None:
            value = 0.0
        kind = "float" if key in ("rope_theta", "max_wh_ratio") else "int"
        out[f"vision_{key}"] = _checked(f"vision_config.{key}", value, kind)
    return out


def _v41_quant_fields(quant, expert_dtype) -> dict[str, Any]:
    if expert_dtype is not None and expert_dtype != _V41_QUANT["expert_dtype"]:
        raise ConfigError(f"config field expert_dtype={expert_dtype!r}: only 'fp4' is supported")
    if quant is None:
        return {}
    out = {}
    for key, value in _checked_dict("quantization_config", quant).items():
        if key == "weight_block_size":
            block = _checked_list("quantization_config.weight_block_size", value)
            if len(block) != 2:
                raise ConfigError(f"quantization_config.weight_block_size must be two ints, got "
                                  f"{block}")
            out["fp8_block"] = tuple(_checked("quantization_config.weight_block_size", b, "int")
                                     for b in block)
        elif key in _V41_QUANT:
            if value != _V41_QUANT[key]:
                raise ConfigError(f"quantization_config.{key}={value!r}: only "
                                  f"{_V41_QUANT[key]!r} is supported")
        else:
            raise ConfigError(f"unknown quantization_config field {key!r}")
    return out
