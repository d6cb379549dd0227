"""DeepSeek-V4.1 checkpoint format: the official inventory from the config (counts, bytes and
dtypes against the published numbers), our writer's 32x32-FP8 / FP4 / FP8-table layout read
back within format rounding and bit-exactly against re-quantization, and errors that name the
tensor and the file."""

import json
import math
import os
import shutil
from collections import Counter

import jax
import ml_dtypes
import numpy as np
import pytest

import deepinfer_fn as di
from deepinfer_fn.checkpoint import quant
from deepinfer_fn.checkpoint.layout import index_json, inventory, weight_tensors
from deepinfer_fn.checkpoint.safetensors_io import CheckpointError, SafetensorsFile, save_file
from deepinfer_fn.params import BF16, E8M0, F32, FP4, FP8, FP8_CODES, is_spec, param_specs

TINY = "v4.1-tiny"


# ------------------------------------------------------------------------ official inventory
@pytest.fixture(scope="module")
def flash():
    cfg = di.ModelConfig.preset("v4.1-flash")
    return cfg, inventory(cfg)


def _category(name):
    if name.startswith(("vision.", "aligner.", "image_")):
        return "vision"
    if name.startswith("mtp."):
        return "dspark"
    if ".engram.embed." in name:
        return "tables"
    return "backbone"


def test_v41_flash_inventory_counts_and_elements(flash):
    """§V6.1 / §V1.4: 96,085 tensors in 48 shards, tables in 47-48, element totals exact."""
    cfg, inv = flash
    names = [t.name for t in inv]
    assert len(names) == len(set(names)) == 96_085
    assert sorted({t.shard for t in inv}) == list(range(1, 49))
    assert {t.name for t in inv if t.shard >= 47} == {
        f"layers.{i}.engram.embed.{w}" for i in (1, 14) for w in ("weight", "scale")}
    assert [t.name for t in inv if t.shard == 47][0] == "layers.1.engram.embed.weight"
    elements = Counter()
    for t in inv:
        elements[_category(t.name)] += t.logical
    assert elements["backbone"] == 551_880_835_184
    assert elements["tables"] == 98_305_579_008 + 98_308_270_592
    assert elements["dspark"] == 14_225_362_530
    assert elements["vision"] == 485_268_480
    assert sum(t.logical for t in inv) == 763_205_315_794
    assert sum(t.nbytes for t in inv if _category(t.name) == "vision") == 970_536_960
    assert sum(1 for t in inv if _category(t.name) == "vision") == 266
    # storage (§V1.4): routed experts 288.8 GB with their scales, tables 264 B per row
    experts = sum(t.nbytes for t in inv
                  if ".ffn.experts." in t.name and t.name.startswith("layers."))
    assert round(experts / 1e9, 1) == 288.8
    assert sum(t.nbytes for t in inv if _category(t.name) == "tables") == \
        (384_006_168 + 384_016_682) * 264
    assert not any("hc_head" in n or "tid2eid" in n or n.endswith(".ape") or ".indexer.compressor."
                   in n or n.startswith(("mtp.0.e_proj", "mtp.0.enorm")) for n in names)
    index = index_json(inv)
    assert len(index["weight_map"]) == 96_085
    assert index["weight_map"]["layers.14.engram.embed.scale"] == "model-00048-of-00048.safetensors"
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in inv)


def test_v41_flash_tensor_table(flash):
    """Names, stored shapes and dtypes of §V6.1-6.2 and §V5.1, spelled out."""
    _, inv = flash
    by = {t.name: (list(t.shape), t.dtype) for t in inv}
    want = {
        "embed.weight": ([129280, 5120], "BF16"),
        "layers.0.attn.q_norm.weight": ([1280], "BF16"),
        "layers.0.attn.wq_a.weight": ([1280, 5120], "F8_E4M3"),
        "layers.0.attn.wq_a.scale": ([40, 160], "F8_E8M0"),
        "layers.0.attn.wq_b.scale": ([1024, 40], "F8_E8M0"),
        "layers.3.attn.wo_a.weight": ([8192, 4096], "F8_E4M3"),
        "layers.3.attn.wo_a.scale": ([256, 128], "F8_E8M0"),
        "layers.5.attn.attn_sink": ([64], "F32"),
        "layers.5.hc_attn_fn": ([24, 20480], "F32"),
        "layers.2.attn.compressor.wkv.weight": ([512, 5120], "BF16"),
        "layers.14.attn.compressor.wgate.weight": ([512, 5120], "BF16"),
        "layers.20.attn.compressor.norm.weight": ([512], "BF16"),
        "layers.20.attn.indexer.wk.weight": ([128, 512], "BF16"),
        "layers.8.attn.indexer.k_norm.weight": ([128], "BF16"),
        "layers.36.attn.indexer.wq_b.weight": ([4096, 1280], "F8_E4M3"),
        "layers.36.attn.indexer.weights_proj.weight": ([32, 5120], "BF16"),
        "layers.39.ffn.gate.weight": ([384, 5120], "BF16"),
        "layers.39.ffn.gate.bias": ([384], "F32"),
        "layers.39.ffn.gate.bias_vl": ([384], "F32"),
        "layers.0.ffn.experts.383.w1.weight": ([2304, 2560], "I8"),
        "layers.0.ffn.experts.383.w3.scale": ([2304, 160], "F8_E8M0"),
        "layers.0.ffn.experts.0.w2.weight": ([5120, 1152], "I8"),
        "layers.0.ffn.experts.0.w2.scale": ([5120, 72], "F8_E8M0"),
        "layers.7.ffn.shared_experts.w2.weight": ([5120, 2304], "F8_E4M3"),
        "layers.1.engram.embed.weight": ([384006168, 256], "F8_E4M3"),
        "layers.14.engram.embed.scale": ([384016682, 8], "F8_E8M0"),
        "layers.1.engram.wkv.weight": ([25600, 6144], "F8_E4M3"),
        "layers.1.engram.wkv.scale": ([800, 192], "F8_E8M0"),
        "layers.14.engram.q_weight": ([4, 5120], "BF16"),
        "layers.14.engram.k_weight": ([4, 5120], "BF16"),
        "mtp.0.main_proj.weight": ([5120, 15360], "F8_E4M3"),
        "mtp.0.main_norm.weight": ([5120], "BF16"),
        "mtp.1.ffn.experts.127.w1.weight": ([2304, 2560], "I8"),
        "mtp.2.attn.wq_a.weight": ([1280, 5120], "F8_E4M3"),
        "mtp.2.norm.weight": ([5120], "BF16"),
        "mtp.2.markov_head.embed.weight": ([129280, 256], "BF16"),
        "mtp.2.markov_head.head.weight": ([129280, 256], "BF16"),
        "mtp.2.confidence_head.proj.weight": ([1, 5376], "BF16"),
        "vision.blocks.31.attn.wqkv.weight": ([3072, 1024], "BF16"),
        "aligner.w1.weight": ([5120, 9216], "BF16"),
        "image_newline": ([5120], "BF16"),
    }
    assert {n: by.get(n) for n in want} == want
    for absent in ("layers.2.attn.compressor.ape", "layers.20.attn.compressor.wgate.weight",
                   "layers.24.attn.indexer.wk.weight", "layers.3.attn.indexer.wq_b.weight",
                   "mtp.0.ffn.experts.128.w1.weight", "mtp.2.hc_head_fn", "hc_head_fn"):
        assert absent not in by
    # §V0 (d): six tensors of one layer's shard add up to the published 42,478,080 bytes
    sizes = {t.name: t.nbytes for t in inv if t.shard == 3}
    six = [f"layers.0.attn.{w}.{k}" for w in ("wo_a", "wkv") for k in ("weight", "scale")]
    six += [f"layers.0.ffn.experts.0.w1.{k}" for k in ("weight", "scale")]
    assert sum(sizes[n] for n in six) == 42_478_080


def test_v4_flash_census_unchanged():
    """The same inventory code gives V4-Flash's published dtype census (docs/MODEL.md §5.1)."""
    inv = weight_tensors(di.ModelConfig.preset("v4-flash"))
    assert len(inv) == 69_187
    assert Counter(t.dtype for t in inv) == {"F8_E4M3": 375, "I8": 33_792, "F8_E8M0": 34_167,
                                             "BF16": 433, "F32": 417, "I64": 3}


# ------------------------------------------------------------------------ writer / loader
@pytest.fixture(scope="module")
def tiny():
    cfg = di.ModelConfig.preset(TINY)
    return di.init_params(cfg, jax.random.key(3))


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory, tiny):
    path = tmp_path_factory.mktemp("v41") / "q"
    di.save_params(tiny, path, quantize=True)
    return path


def _ckpt_layout(spec, value):
    """Internal array (leading layer axes allowed) -> the stored [.., o, i] matrices."""
    if spec.layout in ("linear", "experts"):
        return np.swapaxes(value, -1, -2)
    if spec.layout == "grouped":
        g, i, r = spec.shape[-3:]
        v = np.swapaxes(value, -1, -2)
        return v.reshape(*v.shape[:-3], g * r, i)
    return value


def _block_bound(w, b0, b1, fmt_max, rel, floor_rel):
    """Per-element rounding bound max(rel |w|, floor_rel * scale) with the block's UE8M0
    scale 2^ceil(log2(amax / fmt_max)) computed here from the [.., o, i] matrix."""
    o, i = w.shape[-2:]
    pad = [(0, 0)] * (w.ndim - 2) + [(0, -o % b0), (0, -i % b1)]
    a = np.pad(np.abs(w), pad)
    blocks = a.reshape(*a.shape[:-2], a.shape[-2] // b0, b0, a.shape[-1] // b1, b1)
    amax = blocks.max(axis=(-3, -1))
    scale = np.exp2(np.ceil(np.log2(np.maximum(amax, 1e-38) / fmt_max)))
    full = np.repeat(np.repeat(scale, b0, -2), b1, -1)[..., :o, :i]
    return np.maximum(rel * np.abs(w), floor_rel * full)


def test_v41_round_trip_within_format_rounding(quantized_dir, tiny):
    cfg = tiny.config
    files = sorted(os.listdir(quantized_dir))
    n = 1 + cfg.num_hidden_layers + cfg.num_mtp_layers + 1 + len(cfg.engram_layer_ids)
    assert files == sorted([f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
                           + ["config.json", "model.safetensors.index.json"])
    hf = json.loads((quantized_dir / "config.json").read_text())
    assert hf["quantization_config"]["weight_block_size"] == [32, 32]
    assert hf["quantization_config"]["expert_dtype"] == "fp4" and "expert_dtype" not in hf
    # every header entry is the inventory's (name, shape, dtype, shard file)
    want = {t.name: (t.shape, t.dtype, f"model-{t.shard:05d}-of-{n:05d}.safetensors")
            for t in inventory(cfg)}
    got = {}
    for f in files:
        if f.endswith(".safetensors"):
            st = SafetensorsFile(quantized_dir / f)
            got.update({k: (st.shape(k), st.dtype_name(k), f) for k in st.keys()})
    assert got == want
    index = json.loads((quantized_dir / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {k: v[2] for k, v in want.items()}

    loaded = di.load_params(quantized_dir)
    assert loaded.config == cfg
    b0, b1 = cfg.fp8_block
    specs = jax.tree.leaves(param_specs(cfg), is_leaf=is_spec)
    originals = jax.tree_util.tree_flatten_with_path(tiny.weights)[0]
    seen = Counter()
    for spec, (path, w0), w1 in zip(specs, originals, jax.tree.leaves(loaded.weights)):
        where = jax.tree_util.keystr(path)
        if spec.fmt in (FP8_CODES, E8M0):
            assert w1.dtype == np.uint8
            np.testing.assert_array_equal(np.asarray(w1), np.asarray(w0), err_msg=where)
            seen[spec.fmt] += 1
            continue
        want_, got_ = (_ckpt_layout(spec, np.asarray(x, np.float64)) for x in (w0, w1))
        err = np.abs(got_ - want_)
        if spec.fmt == FP8:      # e4m3 half ulp: 2^-4 relative, 2^-10 of the block scale near 0
            bound = _block_bound(want_, b0, b1, 448.0, 2 ** -4, 2 ** -10)
        elif spec.fmt == FP4:    # e2m1 half ulp: 2^-2 relative, 2^-2 of the 1x32 group scale
            bound = _block_bound(want_, 1, cfg.fp4_group, 6.0, 2 ** -2, 2 ** -2)
        elif spec.fmt == BF16:
            bound = 2 ** -8 * np.abs(want_)
        else:
            assert spec.fmt == F32, spec
            bound = np.zeros_like(want_)
        assert np.all(err <= bound), (where, float((err - bound).max()))
        if spec.fmt in (FP8, FP4):
            assert err.max() > 0, f"{where} was not quantized"
        seen[spec.fmt] += 1
    assert all(seen[f] for f in (FP8, FP4, BF16, F32, FP8_CODES, E8M0)), seen


def _requant(spec, m, cfg):
    """Re-quantize -> dequantize one stored [o, i] matrix with our codec."""
    if spec.fmt == FP8:
        return quant.dequantize_fp8_block(*quant.quantize_fp8_block(m, cfg.fp8_block),
                                          cfg.fp8_block)
    return quant.dequantize_fp4(*quant.quantize_fp4(m, cfg.fp4_group), cfg.fp4_group)


def test_v41_round_trip_bit_exact_against_requantization(quantized_dir, tiny):
    cfg = tiny.config
    loaded = di.load_params(quantized_dir)
    specs = jax.tree.leaves(param_specs(cfg), is_leaf=is_spec)
    checked = 0
    for spec, w0, w1 in zip(specs, jax.tree.leaves(tiny.weights), jax.tree.leaves(loaded.weights)):
        if spec.fmt not in (FP8, FP4):
            continue
        m0 = _ckpt_layout(spec, np.asarray(w0, np.float32))
        flat = m0.reshape(-1, *m0.shape[-2:])
        want = np.stack([_requant(spec, m, cfg) for m in flat]).reshape(m0.shape)
        np.testing.assert_array_equal(_ckpt_layout(spec, np.asarray(w1)), want, err_msg=spec.ckpt)
        checked += 1
    assert checked > 20


def test_v41_unquantized_round_trip_is_exact(tmp_path, tiny):
    di.save_params(tiny, tmp_path / "f")
    hf = json.loads((tmp_path / "f" / "config.json").read_text())
    assert "quantization_config" not in hf and hf["model_type"] == "deepseek_v41"
    index = json.loads((tmp_path / "f" / "model.safetensors.index.json").read_text())["weight_map"]
    st = SafetensorsFile(tmp_path / "f" / index["layers.2.engram.embed.weight"])
    assert st.dtype_name("layers.2.engram.embed.weight") == "F8_E4M3"
    assert not any(k.endswith(".scale") and "engram.embed" not in k for k in index)
    loaded = di.load_params(tmp_path / "f")
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(tiny.weights)[0],
                            jax.tree.leaves(loaded.weights)):
        assert a.dtype == b.dtype, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                      err_msg=jax.tree_util.keystr(path))


def test_v41_without_dspark_stages(tmp_path, tiny):
    """A checkpoint without `mtp.*` loads with an empty drafter; asking for it is an error."""
    cfg = tiny.config
    di.save_params(di.init_params(cfg, jax.random.key(1), include_mtp=False), tmp_path / "n",
                   quantize=True)
    assert not di.load_params(tmp_path / "n")["mtp"]
    with pytest.raises(CheckpointError, match=r"missing tensor 'mtp\.\d\."):
        di.load_params(tmp_path / "n", include_mtp=True)


# ------------------------------------------------------------------------ errors
def _mutated(src, dst, tensor, change):
    """Copy of checkpoint `src` with `change(tensors)` applied to the shard holding `tensor`
    (index kept in step); returns (dst, that shard's file name)."""
    shutil.copytree(src, dst)
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    fname = index["weight_map"][tensor]
    st = SafetensorsFile(dst / fname)
    tensors = {k: np.array(st.get(k)) for k in st.keys()}
    del st
    change(tensors)
    save_file(tensors, dst / fname)
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != fname}
    index["weight_map"].update({k: fname for k in tensors})
    index_path.write_text(json.dumps(index))
    return dst, fname


E4M3, UE8M0 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e8m0fnu


def _set(name, value):
    return lambda t: t.__setitem__(name, value)


CASES = [
    ("layers.3.attn.wq_b.weight", lambda t: t.pop("layers.3.attn.wq_b.weight"),
     r"missing tensor 'layers.3.attn.wq_b.weight' in checkpoint .*official layout puts it in "
     r".*FILE"),
    ("head.weight", _set("hc_head_fn", np.zeros((4, 256), np.float32)),
     r"unknown tensor 'hc_head_fn' in .*FILE .*no hc_head"),
    ("layers.5.attn.attn_sink",
     _set("layers.5.attn.indexer.wk.weight", np.zeros((16, 32), np.float32)),
     r"unknown tensor 'layers.5.attn.indexer.wk.weight' in .*FILE"),
    ("layers.2.attn.compressor.wkv.weight",
     _set("layers.2.attn.compressor.wkv.weight", np.zeros((32, 63), ml_dtypes.bfloat16)),
     r"shape mismatch: 'layers.2.attn.compressor.wkv.weight' in .*FILE has shape \[32, 63\], "
     r"expected \[32, 64\]"),
    ("layers.1.engram.embed.weight",
     _set("layers.1.engram.embed.weight", np.zeros((660, 64), ml_dtypes.bfloat16)),
     r"dtype mismatch: 'layers.1.engram.embed.weight' in .*FILE is BF16, expected F8_E4M3"),
    ("layers.0.ffn.gate.bias_vl", _set("layers.0.ffn.gate.bias_vl", np.zeros(8, np.int32)),
     r"dtype mismatch: 'layers.0.ffn.gate.bias_vl' in .*FILE is I32"),
    ("layers.0.attn.wq_a.weight",
     _set("layers.0.attn.wq_a.scale", np.zeros((1, 1), np.uint8).view(UE8M0)),
     r"scale 'layers.0.attn.wq_a.scale' in .*FILE has shape \[1, 1\], inconsistent with its "
     r"weight 'layers.0.attn.wq_a.weight' in .*FILE .*blocks 32x32.*expected \[1, 2\]"),
    ("layers.4.ffn.experts.3.w2.weight",
     _set("layers.4.ffn.experts.3.w2.scale", np.zeros((64, 2), np.uint8).view(UE8M0)),
     r"scale 'layers.4.ffn.experts.3.w2.scale' in .*FILE has shape \[64, 2\], inconsistent "
     r"with its weight 'layers.4.ffn.experts.3.w2.weight'.*expected \[64, 1\]"),
    ("layers.0.attn.wkv.weight",
     _set("layers.0.attn.wkv.scale", np.ones((1, 2), ml_dtypes.bfloat16)),
     r"dtype mismatch: scale 'layers.0.attn.wkv.scale' in .*FILE is BF16, expected F8_E8M0"),
    ("layers.0.attn.wo_b.weight", lambda t: t.pop("layers.0.attn.wo_b.scale"),
     r"'layers.0.attn.wo_b.weight' in .*FILE is FP8 but has no scale tensor "
     r"'layers.0.attn.wo_b.scale'"),
    ("layers.2.engram.embed.weight",
     _set("layers.2.engram.embed.scale", np.zeros((864, 1), np.uint8).view(UE8M0)),
     r"scale 'layers.2.engram.embed.scale' in .*FILE has shape \[864, 1\], inconsistent with "
     r"its table 'layers.2.engram.embed.weight' \[864, 64\].*expected \[864, 2\]"),
    ("layers.1.engram.embed.weight",
     _set("layers.1.engram.embed.scale", np.full((660, 2), 255, np.uint8).view(UE8M0)),
     r"'layers.1.engram.embed.scale' in .*FILE contains NaN scales"),
]


@pytest.mark.parametrize("tensor,change,message", CASES, ids=[m[:28] for _, _, m in CASES])
def test_v41_bad_tensors_name_tensor_and_file(tmp_path, quantized_dir, tiny, tensor, change,
                                              message):
    rows = tiny.config.engram_num_embeddings
    assert rows == (660, 864)            # the table shapes spelled out above
    path, fname = _mutated(quantized_dir, tmp_path / "bad", tensor, change)
    with pytest.raises(CheckpointError, match=message.replace("FILE", fname)):
        di.load_params(path)


def test_v41_missing_shard_names_the_file(tmp_path, quantized_dir):
    shutil.copytree(quantized_dir, tmp_path / "s")
    index = json.loads((tmp_path / "s" / "model.safetensors.index.json").read_text())
    victim = index["weight_map"]["layers.2.engram.embed.weight"]
    os.remove(tmp_path / "s" / victim)
    with pytest.raises(CheckpointError, match=rf"missing checkpoint shard .*{victim} .*"
                                              r"layers.2.engram.embed"):
        di.load_params(tmp_path / "s")


def test_v41_index_pointing_elsewhere_is_reported(tmp_path, quantized_dir):
    shutil.copytree(quantized_dir, tmp_path / "i")
    path = tmp_path / "i" / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    index["weight_map"]["norm.weight"] = index["weight_map"]["embed.weight"]
    path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"tensor 'norm.weight' is in model-\d+-of-\d+"
                                              r".safetensors but the index says"):
        di.load_params(tmp_path / "i")


# ------------------------------------------------------------------------ vision tensors
def _vision_config():
    return di.ModelConfig.preset(TINY).replace(
        vision_num_hidden_layers=2, vision_hidden_size=16, vision_num_attention_heads=2,
        vision_intermediate_size=24, vision_patch_size=2, vision_downsample_ratio=3,
        vision_max_image_tokens=16, vision_min_pixels=16)


def test_v41_vision_tensors_are_checked_not_loaded(tmp_path):
    cfg = _vision_config()
    params = di.init_params(cfg, jax.random.key(2), include_mtp=False)
    di.save_params(params, tmp_path / "src", quantize=True)
    vision = [t for t in inventory(cfg, include_mtp=False) if t.name.startswith(
        ("vision.", "aligner.", "image_"))]
    assert len(vision) == 8 * 2 + 10
    assert math.prod([t.shape for t in vision if t.name == "aligner.w1.weight"][0]) == 64 * 9 * 16

    def add(shape_of=lambda t: t.shape):
        def change(tensors):
            tensors.update({t.name: np.zeros(shape_of(t), ml_dtypes.bfloat16) for t in vision})
        return change

    path, _ = _mutated(tmp_path / "src", tmp_path / "ok", "embed.weight", add())
    loaded = di.load_params(path)
    assert set(loaded.weights) == {"embed", "layers", "norm", "head", "mtp"}
    bad = lambda t: (t.shape[0] + 1,) + t.shape[1:] if t.name == "vision.blocks.1.ffn.w2.weight" \
        else t.shape
    path, fname = _mutated(tmp_path / "src", tmp_path / "bad", "embed.weight", add(bad))
    with pytest.raises(CheckpointError, match=rf"shape mismatch: 'vision.blocks.1.ffn.w2.weight' "
                                              rf"in .*{fname} has shape \[17, 24\]"):
        di.load_params(path)
    path, fname = _mutated(tmp_path / "src", tmp_path / "more", "embed.weight",
                           _set("vision.blocks.2.attn.wo.bias", np.zeros(16, np.float32)))
    with pytest.raises(CheckpointError, match=r"unknown tensor 'vision.blocks.2.attn.wo.bias'"):
        di.load_params(path)
