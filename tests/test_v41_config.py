"""DeepSeek-V4.1 config: the official config.json, SGLang's flattened spelling, presets, roles
(§1.3), parameter totals and tensor inventory (§1.4, §6, §7.1), clear errors."""

import json
import math
import pathlib

import jax
import numpy as np
import pytest

import deepinfer_fn as di
from deepinfer_fn.config import PAIR, SWA, TOKEN, ConfigError
from deepinfer_fn.params import FP4, FP8, ckpt_prefixes, is_spec, param_specs, per_layer

DATA = pathlib.Path(__file__).resolve().parent / "data"
OFFICIAL = json.loads((DATA / "v41_config.json").read_text())


def official():
    return json.loads(json.dumps(OFFICIAL))


def sglang_flattened(d):
    """SGLang's spelling: text_config merged into the top level, vision fields prefixed."""
    flat = {k: v for k, v in d.items() if k not in ("text_config", "vision_config")}
    flat.update(d["text_config"])
    flat["model_type"] = d["model_type"]
    for k, v in d["vision_config"].items():
        flat[{"num_hidden_layers": "vision_n_layers", "hidden_size": "vision_dim"}.get(
            k, f"vision_{k}")] = v
    return flat


def test_official_config_equals_preset():
    cfg = di.ModelConfig.from_hf(DATA / "v41_config.json")
    assert cfg == di.ModelConfig.preset("v4.1-flash")
    assert cfg.is_v41 and cfg.hc_pre_from_prev_sublayer and not cfg.q_head_norm  # implicit
    assert cfg.fp8_block == (32, 32) and cfg.rms_norm_eps == 1e-20
    assert cfg.layer_types.count(PAIR) == 18 and cfg.layer_types.count(TOKEN) == 20
    assert set(cfg.mlp_layer_types) == {"moe"}
    hash(cfg)


def test_sglang_flattened_spelling():
    assert di.ModelConfig.from_hf(sglang_flattened(official())) == di.ModelConfig.preset("v4.1-flash")


@pytest.mark.parametrize("name", ["v4.1-flash", "v4.1-mini", "v4.1-tiny"])
def test_to_hf_round_trip(name):
    cfg = di.ModelConfig.preset(name)
    hf = json.loads(json.dumps(cfg.to_hf()))              # through real JSON
    assert di.ModelConfig.from_hf(hf, numerics=cfg.numerics) == cfg
    if name == "v4.1-flash":
        assert hf == official()                         # the official layout, field for field


def test_roles_match_the_sharing_table():
    """§1.3: kv sources, index sources, candidate publisher/consumers of V4.1-Flash."""
    cfg = di.ModelConfig.preset("v4.1-flash")
    kv = [cfg.kv_source_of(l) for l in range(40)]
    assert kv == [None, None] + [2] * 6 + [8] * 6 + [14] * 6 + [20] * 20
    ix = [cfg.index_source_of(l) for l in range(40)]
    assert ix[:20] == kv[:20] and ix[20:] == [20] * 4 + [24] * 4 + [28] * 4 + [32] * 4 + [36] * 4
    assert {l: cfg.candidate_role(l) for l in range(40) if cfg.candidate_role(l)} == {
        20: "publish", 24: "consume", 28: "consume", 32: "consume", 36: "consume"}
    kinds = cfg.layer_kinds()
    assert kinds[1][0] == SWA + "+engram" and kinds[14][0].endswith("+engram")
    assert len(set(kinds)) == 8


def test_equal_kinds_have_equal_weights():
    """What scanning needs: layers of one kind have the same weight tree and shapes."""
    cfg = di.ModelConfig.preset("v4.1-flash", scan_layers=False)
    layers = list(param_specs(cfg, include_mtp=False)["layers"])
    shape_tree = lambda t: jax.tree.map(lambda s: (s.shape, s.ckpt), t, is_leaf=is_spec)
    by_kind = {}
    for kind, layer in zip(cfg.layer_kinds(), layers):
        by_kind.setdefault(kind, []).append(shape_tree(layer))
    for kind, trees in by_kind.items():
        assert all(t == trees[0] for t in trees), kind


def test_parameter_counts_of_v41_flash():
    """Spec §1.4, exactly."""
    counts = di.count_params(di.ModelConfig.preset("v4.1-flash"))
    assert counts["total"] == 551_880_835_184
    assert counts["engram_tables"] == 196_613_849_600
    assert counts["active_excl_embedding"] == 16_130_588_784
    assert counts["active_excl_embedding_and_head"] == 15_468_675_184
    assert counts["active"] == 16_130_588_784 + 661_913_600          # V4's convention
    assert counts["mtp_total"] == 14_225_362_530                      # DSpark, 3 stages + heads
    assert counts["dspark_stage"] == 4_693_504_118
    assert counts["dspark_stage_active"] == 269_824_118


def test_parameter_breakdown_of_v41_flash():
    """The per-category totals of §1.4, summed over our own weight specs by name."""
    cfg = di.ModelConfig.preset("v4.1-flash")
    specs, sums = param_specs(cfg, include_mtp=False), {}
    for path, s in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]:
        keys = [getattr(p, "key", None) for p in path]
        name = s.ckpt
        cat = ("scale" if name == "engram.embed.scale" else
               "tables" if name == "engram.embed.weight" else
               "engram" if name.startswith("engram.") else
               "attention" if name.startswith("attn.") else
               "routed" if "experts.{e}" in name else
               "router_shared" if name.startswith("ffn.") else
               "mhc_norms" if name.startswith(("hc_", "attn_norm", "ffn_norm")) else keys[0])
        sums[cat] = sums.get(cat, 0) + math.prod(s.shape)
    assert sums["embed"] == sums["head"] == 661_913_600 and sums["norm"] == 5120
    assert sums["attention"] == 5_126_564_864
    assert sums["mhc_norms"] == 39_733_360
    assert sums["router_shared"] == 1_494_251_520
    assert sums["routed"] == 543_581_798_400
    assert sums["engram"] == 314_654_720
    assert sums["tables"] == 98_305_579_008 + 98_308_270_592
    assert sums["scale"] == (384_006_168 + 384_016_682) * 8


def test_tensor_inventory_of_v41_flash():
    """§6 / §7.1: the official checkpoint has 96,085 tensors, 266 of them the vision tower
    (not modelled yet); FP8 weights come with a .scale, FP4 experts likewise."""
    cfg = di.ModelConfig.preset("v4.1-flash")
    specs = param_specs(cfg)
    names = []
    for s, prefix in zip(jax.tree.leaves(specs, is_leaf=is_spec),
                         jax.tree.leaves(ckpt_prefixes(cfg, specs))):
        for spec, p in per_layer(s, prefix):
            experts = range(spec.shape[0]) if spec.layout == "experts" else [None]
            for e in experts:
                name = p + spec.ckpt.format(e=e)
                names.append(name)
                if spec.fmt in (FP8, FP4):
                    names.append(name.removesuffix(".weight") + ".scale")
    assert len(set(names)) == len(names) == 96_085 - 266
    assert "layers.14.engram.embed.scale" in names and "mtp.0.main_proj.scale" in names
    assert "mtp.2.confidence_head.proj.weight" in names and "layers.24.attn.indexer.wk.weight" \
        not in names and "layers.20.attn.compressor.wgate.weight" not in names


def test_mini_preset_fits_one_h200_and_has_every_mechanism():
    cfg = di.ModelConfig.preset("v4.1-mini")
    counts = di.count_params(cfg)
    rows = sum(cfg.engram_num_embeddings)
    table_bytes = rows * (cfg.engram_head_dim + cfg.engram_head_dim // 32)   # FP8 + UE8M0
    total_bytes = 2 * (counts["total"] + counts["mtp_total"]) + table_bytes
    assert total_bytes < 100 * 2 ** 30, total_bytes
    assert counts["engram_tables"] > 5e9                     # gathers hit a multi-GB table
    assert set(cfg.layer_types) == {SWA, PAIR, TOKEN}
    roles = {r for kind, _ in cfg.layer_kinds() for r in kind.split("+")[1:]}
    assert roles == {"kv_source", "index_source", "candidate_publish", "candidate_consume",
                     "engram"}
    engram_kinds = {cfg.layer_kind(l)[0].split("+")[0] for l in cfg.engram_layer_ids}
    assert engram_kinds == {SWA, PAIR}                      # as V4.1: before 1 and 14
    readers = {cfg.layer_types[l] for l in range(cfg.num_hidden_layers)
               if cfg.layer_kind(l)[0] in (PAIR, TOKEN)}
    assert readers == {PAIR, TOKEN}
    assert cfg.candidate_topk_blocks * cfg.candidate_block_size < 4096  # bites at 4k context
    assert cfg.dspark_block_size and cfg.num_mtp_layers == 3
    assert cfg.engram_compressed_vocab_size == 99092 and cfg.vocab_size == 129280


def test_tiny_preset_builds_params():
    cfg = di.ModelConfig.preset("v4.1-tiny")
    params = di.init_params(cfg, jax.random.key(0))
    e = params["layers"][2]["engram"]
    assert e["table"].dtype == np.uint8 and e["table"].shape == (cfg.engram_num_embeddings[1], 64)
    assert e["table_scale"].shape == (cfg.engram_num_embeddings[1], 2)
    assert "engram" not in params["layers"][3] and "wgate" in params["layers"][2]["attn"]["compressor"]
    assert "wgate" not in params["layers"][4]["attn"]["compressor"]
    assert "compressor" not in params["layers"][6]["attn"] and "wq_b" in params["layers"][6]["attn"]["indexer"]
    counts = di.count_params(cfg)
    sizes = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params.weights)[0]:
        key = jax.tree_util.keystr(path)
        kind = "scale" if "table_scale" in key else "table" if "'table'" in key else (
            "mtp" if key.startswith("['mtp']") else "backbone")
        sizes[kind] = sizes.get(kind, 0) + leaf.size
    assert sizes["backbone"] == counts["total"] and sizes["mtp"] == counts["mtp_total"]
    assert sizes["table"] == counts["engram_tables"]


# ------------------------------------------------------------------------------ errors
def _text(**kv):
    return lambda d: d["text_config"].update(kv)


@pytest.mark.parametrize("mutate,message", [
    (_text(hiden_size=5120), "unknown config field 'hiden_size'"),
    (lambda d: d.update(hidden_size=5120), "unknown config field 'hidden_size' at the top level"),
    (_text(compress_ratios=[0, 0] + [4] * 38 + [0] * 3), "compress_ratios contains [4]"),
    (_text(compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0] * 2), "compress_ratios has 42"),
    (_text(compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0, 1, 0]), "DSpark stages must be 0"),
    (_text(kv_source_layer_ids=[2, 8, 14]), "no kv source"),
    (_text(kv_source_layer_ids=[0, 2, 8, 14, 20]), "sliding-window"),
    (_text(index_source_layer_ids=[2, 8, 14, 24, 28, 32, 36]), "not in index_source_layer_ids"),
    (_text(kv_source_layer_ids=[8, 2, 14, 20]), "increasing"),
    (_text(candidate_source_layer_id=21), "candidate_source_layer_id=21"),
    (_text(engram_num_embeddings=[384006168, 384016683]), "engram_num_embeddings"),
    (_text(engram_layer_ids=[1, 14, 40], engram_num_embeddings=[1, 2, 3]), "engram_layer_ids"),
    (_text(engram_compressed_vocab_size=200000), "engram_compressed_vocab_size=200000"),
    (_text(num_hash_layers=3), "no hash-routed layers"),
    (_text(num_key_value_heads=8), "one shared KV head"),
    (_text(topk_method="greedy"), "topk_method"),
    (_text(rms_norm_eps=0), "rms_norm_eps"),
    (_text(hidden_size="5120"), "hidden_size must be an int"),
    (_text(dspark_num_experts_per_tok=200), "dspark_num_experts_per_tok=200"),
    (_text(dspark_noise_token_id=200000), "dspark_noise_token_id"),
    (_text(model_type="deepseek_v4"), "text_config model_type"),
    (_text(pad_token_id=5), "pad_token_id is 2 at the top level but 5"),
    (lambda d: d.update(text_config=[1]), "text_config must be a JSON object"),
    (lambda d: d.update(image_token_id=130000), "image_token_id=130000"),
    (lambda d: d["quantization_config"].update(scale_fmt="fp32"), "scale_fmt"),
    (lambda d: d["quantization_config"].update(group=7), "unknown quantization_config field"),
    (lambda d: d["quantization_config"].update(weight_block_size=[32]), "weight_block_size"),
    (lambda d: d["vision_config"].update(n_layers=3), "unknown vision_config field 'n_layers'"),
    (lambda d: d["vision_config"].update(num_attention_heads=5), "not divisible"),
    (lambda d: d.update(model_type="deepseek_v5"), "model_type"),
])
def test_bad_v41_configs_raise_clear_errors(mutate, message):
    d = official()
    mutate(d)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        di.ModelConfig.from_hf(d)


def test_flattened_spelling_conflicts():
    flat = sglang_flattened(official())
    flat["vision_num_hidden_layers"] = 31
    with pytest.raises(ConfigError, match="vision_num_hidden_layers=31 disagrees"):
        di.ModelConfig.from_hf(flat)
    flat = sglang_flattened(official())
    flat["vision_foo"] = 1
    with pytest.raises(ConfigError, match="unknown vision_config field 'foo'"):
        di.ModelConfig.from_hf(flat)


def test_v41_fields_stay_off_v4():
    with pytest.raises(ConfigError, match="engram_layer_ids=.* is a DeepSeek-V4.1 field"):
        di.ModelConfig.preset("v4-flash", engram_layer_ids=(1,))
    with pytest.raises(ConfigError, match="unknown layer_types"):
        di.ModelConfig.preset("v4-flash").replace(layer_types=(PAIR,) * 43)
    with pytest.raises(ConfigError, match="unknown layer_types"):
        di.ModelConfig.preset("v4.1-tiny").replace(layer_types=("compressed_sparse_attention",) * 8)
