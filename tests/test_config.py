"""ModelConfig: presets, parameter counts (§1.4), HF spellings, clear errors."""

import json

import pytest

import deepinfer_fn as di
from deepinfer_fn.config import CSA, HCA, SWA, ConfigError
from conftest import GOLDEN

OFFICIAL_V4_FLASH = {  # spec §1.1, every field of the official config.json
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
    "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
    "sliding_window": 128, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "compress_rope_theta": 160000, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048, "num_hash_layers": 3, "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 1, "expert_dtype": "fp4",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
    "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
    "torch_dtype": "bfloat16", "use_cache": True, "transformers_version": "4.57.1",
}


def test_official_config_equals_preset():
    assert di.ModelConfig.from_hf(OFFICIAL_V4_FLASH) == di.ModelConfig.preset("v4-flash")


def test_preset_schedule_matches_spec():
    cfg = di.ModelConfig.preset("v4-flash")
    assert cfg.layer_types[:3] == (SWA, SWA, CSA)
    assert cfg.layer_types.count(CSA) == 21 and cfg.layer_types.count(HCA) == 20
    assert cfg.mlp_layer_types.count("hash_moe") == 3
    hash(cfg)  # static metadata must be hashable


def test_parameter_counts_of_v4_flash():
    """Exact figures of spec §1.4, computed from our own weight specs."""
    counts = di.count_params(di.ModelConfig.preset("v4-flash"))
    assert counts["total"] == 284_332_240_471
    assert counts["active"] == 13_799_632_471
    assert counts["mtp_total"] == 6_610_048_891
    assert counts["mtp_active"] == 318_592_891


def test_mini_preset_size_and_coverage():
    cfg = di.ModelConfig.preset("mini")
    counts = di.count_params(cfg)
    assert 2.0e9 <= counts["total"] <= 3.0e9, counts
    assert counts["total"] * 2 < 100 * 2**30  # bf16 weights leave room on one H200
    assert set(cfg.layer_types) == {SWA, CSA, HCA}
    assert set(cfg.mlp_layer_types) == {"hash_moe", "moe"}


def test_transformers_spelling_roundtrip():
    cfg = di.ModelConfig.from_hf(GOLDEN / "cfg_a")
    assert cfg.hca_ratio == 16 and cfg.qk_rope_head_dim == 8 and cfg.sliding_window == 8
    assert cfg.yarn_original_max_position == 64
    assert di.ModelConfig.from_hf(cfg.to_hf()) == cfg


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d.update(hiden_size=4096), "unknown config field 'hiden_size'"),
    (lambda d: d.update(compress_ratios=[0, 3] + [4] * 42), "compress_ratios contains [3]"),
    (lambda d: d.update(num_hash_layers=50), "num_hash_layers=50"),
    (lambda d: d.update(o_groups=7), "not divisible by o_groups"),
    (lambda d: d.update(num_experts_per_tok=300), "num_experts_per_tok=300"),
    (lambda d: d.update(qk_rope_head_dim=1024), "qk_rope_head_dim"),
    (lambda d: d.update(num_key_value_heads=8), "one shared KV head"),
    (lambda d: d.update(scoring_func="softmax"), "sqrtsoftplus"),
    (lambda d: d.pop("num_hidden_layers"), "num_hidden_layers"),
    (lambda d: d.update(rope_scaling={"type": "linear", "factor": 2}), "yarn"),
    (lambda d: d.update(model_type="llama"), "model_type"),
])
def test_bad_configs_raise_clear_errors(mutate, message):
    d = json.loads(json.dumps(OFFICIAL_V4_FLASH))
    mutate(d)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        di.ModelConfig.from_hf(d)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset"):
        di.ModelConfig.preset("v5-huge")


def test_v4_outputs_unchanged_by_v41_fields():
    """V4's config.json and parameter-count keys carry nothing of V4.1."""
    cfg = di.ModelConfig.preset("v4-flash")
    hf = cfg.to_hf()
    assert not any(k.startswith(("engram", "dspark", "kv_source", "index_source", "candidate",
                                 "vision", "hc_pre", "q_head")) for k in hf)
    assert hf["model_type"] == "deepseek_v4" and "text_config" not in hf
    assert set(di.count_params(cfg)) == {"total", "active", "mtp_total", "mtp_active"}
    assert not cfg.is_v41 and cfg.layer_kinds() == tuple(zip(cfg.layer_types, cfg.mlp_layer_types))
    assert cfg.kv_source_of(5) is None and cfg.candidate_role(5) == ""


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d.update(dspark_block_size=5), "DSpark checkpoints"),
    (lambda d: d.update(engram_layer_ids=[1]), "is a DeepSeek-V4.1 field"),
    (lambda d: d.update(text_config=3), "deepseek_v4.* with a text_config"),
])
def test_v4_config_with_v41_fields(mutate, message):
    d = json.loads(json.dumps(OFFICIAL_V4_FLASH))
    mutate(d)
    with pytest.raises(ConfigError, match=message):
        di.ModelConfig.from_hf(d)
