"""Checkpoint loading: both naming schemes, our FP8/FP4 quantizer round trip, clear errors."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import deepinfer_fn as di
from conftest import GOLDEN, golden_params
from deepinfer_fn.checkpoint.loader import checkpoint_shape
from deepinfer_fn.checkpoint.safetensors_io import CheckpointError, SafetensorsFile, save_file
from deepinfer_fn.params import FP4, FP8, BF16, is_spec, param_specs


@pytest.fixture(scope="module")
def tiny_params():
    return di.init_params(di.ModelConfig.preset("tiny"), jax.random.key(0))


def _leaves(params):
    return jax.tree_util.tree_flatten_with_path(params.weights)[0]


def test_official_names_load_like_transformers_names(tmp_path):
    """Re-saving the transformers checkpoint under official names gives identical params."""
    params = golden_params("cfg_a")
    di.save_params(params, tmp_path / "official")
    names = SafetensorsFile(tmp_path / "official" / "model.safetensors").keys()
    assert "layers.1.attn.kv_norm.weight" in names and "embed.weight" in names
    assert not any(n.startswith("model.") for n in names)
    again = di.load_params(tmp_path / "official")
    assert again.config == params.config
    for (path, a), b in zip(_leaves(params), jax.tree.leaves(again.weights)):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def test_quantized_checkpoint_round_trip(tmp_path, tiny_params):
    """Our quantizer writes the official FP8/FP4/UE8M0 layout; loading it back is within each
    format's rounding: FP8 e4m3 half-ulp (2^-4 relative, or 2^-10 of the block scale near 0),
    FP4 e2m1 (2^-2 relative, or 2^-2 of the group scale below it), bf16 2^-8 relative."""
    cfg = tiny_params.config
    di.save_params(tiny_params, tmp_path / "q", quantize=True, max_shard_bytes=60_000)
    files = os.listdir(tmp_path / "q")
    assert "model.safetensors.index.json" in files and len([f for f in files if f.startswith("model-")]) > 1
    hf = json.load(open(tmp_path / "q" / "config.json"))
    assert hf["quantization_config"]["weight_block_size"] == [128, 128]
    index = json.load(open(tmp_path / "q" / "model.safetensors.index.json"))["weight_map"]
    st = SafetensorsFile(tmp_path / "q" / index["layers.0.attn.wq_a.weight"])
    assert st.dtype_name("layers.0.attn.wq_a.weight") == "F8_E4M3"
    assert st.dtype_name("layers.0.attn.wq_a.scale") == "F8_E8M0"
    st = SafetensorsFile(tmp_path / "q" / index["layers.0.ffn.experts.0.w1.weight"])
    assert st.dtype_name("layers.0.ffn.experts.0.w1.weight") == "I8"
    assert st.shape("layers.0.ffn.experts.0.w1.weight") == (cfg.moe_intermediate_size, cfg.hidden_size // 2)

    loaded = di.load_params(tmp_path / "q")
    specs = jax.tree.leaves(param_specs(cfg), is_leaf=is_spec)
    for spec, (path, want), got in zip(specs, _leaves(tiny_params), jax.tree.leaves(loaded.weights)):
        want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
        err = np.abs(got - want)
        where = jax.tree_util.keystr(path)
        if spec.fmt == FP8:
            block_scale = 2.0 ** np.ceil(np.log2(np.abs(want).max() / 448))  # one block at tiny sizes
            assert np.all(err <= np.maximum(2 ** -4 * np.abs(want), 2 ** -10 * block_scale) * 1.0001), where
        elif spec.fmt == FP4:
            groups = want.swapaxes(-1, -2)  # checkpoint rows are [out, in]; groups run along in
            amax = np.abs(groups.reshape(*groups.shape[:-1], -1, 32)).max(-1, keepdims=True)
            scale = 2.0 ** np.ceil(np.log2(amax / 6))
            bound = np.maximum(2 ** -2 * np.abs(groups.reshape(*groups.shape[:-1], -1, 32)), 2 ** -2 * scale)
            e = np.abs(got.swapaxes(-1, -2) - groups).reshape(bound.shape)
            assert np.all(e <= bound * 1.0001), where
        elif spec.fmt == BF16:
            assert np.all(err <= 2 ** -8 * np.abs(want)), where
        else:
            np.testing.assert_array_equal(got, want, err_msg=where)
        assert err.max() > 0 or spec.fmt not in (FP8, FP4), f"{where} was not quantized"


def _copy_golden(tmp_path, name="cfg_a"):
    dst = tmp_path / name
    shutil.copytree(GOLDEN / name, dst, ignore=shutil.ignore_patterns("reference.*"))
    return dst


def _rewrite(path, change):
    st = SafetensorsFile(path / "model.safetensors")
    tensors = {k: np.array(st.get(k)) for k in st.keys()}
    del st
    change(tensors)
    save_file(tensors, path / "model.safetensors")


def test_missing_shard_names_the_file(tmp_path, tiny_params):
    di.save_params(tiny_params, tmp_path / "s", max_shard_bytes=100_000)
    victim = sorted(f for f in os.listdir(tmp_path / "s") if f.startswith("model-"))[1]
    os.remove(tmp_path / "s" / victim)
    with pytest.raises(CheckpointError, match=f"missing checkpoint shard .*{victim}"):
        di.load_params(tmp_path / "s")


def test_truncated_file_is_reported(tmp_path):
    path = _copy_golden(tmp_path)
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="model.safetensors.*(truncated|corrupt)"):
        di.load_params(path)


def test_corrupt_header_is_reported(tmp_path):
    path = _copy_golden(tmp_path)
    f = path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[10:20] = b"\xff" * 10
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt JSON header"):
        di.load_params(path)


@pytest.mark.parametrize("change,message", [
    (lambda t: t.pop("model.layers.2.attn.wkv.weight"), r"missing tensor 'layers.2.attn.wkv.weight'"),
    (lambda t: t.update({"model.layers.9.attn.wkv.weight": np.zeros((32, 64), np.float32)}),
     r"unknown tensor 'model.layers.9.attn.wkv.weight' in .*model.safetensors"),
    (lambda t: t.update({"model.layers.2.attn.wkv.weight": np.zeros((32, 63), np.float32)}),
     r"shape mismatch: 'model.layers.2.attn.wkv.weight' in .*has shape \[32, 63\], expected \[32, 64\]"),
    (lambda t: t.update({"model.layers.0.ffn.gate.tid2eid": np.zeros((256, 2), np.float32)}),
     r"dtype mismatch: 'model.layers.0.ffn.gate.tid2eid'.* is F32, expected I64"),
    (lambda t: t.update({"model.layers.2.attn.wkv.weight": np.zeros((32, 64), np.int32)}),
     r"dtype mismatch: 'model.layers.2.attn.wkv.weight'.* is I32"),
    (lambda t: t.update({"model.layers.0.ffn.gate.tid2eid": np.full((256, 2), 99, np.int64)}),
     r"tid2eid' .* expert ids outside \[0, 8\)"),
    (lambda t: t.__setitem__("model.norm.weight", np.full(64, np.nan, np.float32)),
     r"'model.norm.weight' .* NaN"),
])
def test_bad_tensors_raise_naming_tensor_and_file(tmp_path, change, message):
    path = _copy_golden(tmp_path)
    _rewrite(path, change)
    with pytest.raises(CheckpointError, match=message):
        di.load_params(path)


def test_fp8_without_scale_is_an_error(tmp_path, tiny_params):
    di.save_params(tiny_params, tmp_path / "q", quantize=True)
    _rewrite(tmp_path / "q", lambda t: t.pop("layers.0.attn.wq_a.scale"))
    with pytest.raises(CheckpointError, match="wq_a.weight.* is FP8 but has no scale"):
        di.load_params(tmp_path / "q")


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        di.load_params(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        di.load_params(tmp_path / "empty")


def test_bf16_load_keeps_fp32_where_the_policy_says():
    params = di.load_params(GOLDEN / "cfg_a", dtype=jnp.bfloat16)
    layer = params["layers"][1]
    assert params["embed"].dtype == jnp.bfloat16 and layer["attn"]["wq_a"].dtype == jnp.bfloat16
    for leaf in (layer["hc_attn"]["fn"], layer["attn"]["sinks"], layer["attn"]["compressor"]["ape"],
                 layer["attn_norm"], params["layers"][2]["ffn"]["gate_bias"]):
        assert leaf.dtype == jnp.float32
    assert layer["ffn"]["tid2eid"].dtype == jnp.int32
