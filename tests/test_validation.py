"""The validation layer at the public boundary: every bad argument raises the project's own error
type at the call, with a message naming the argument, and before anything is compiled."""

from __future__ import annotations

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deepinfer_fn as di
from deepinfer_fn import validate as V
from deepinfer_fn.config import ConfigError
from deepinfer_fn.engine.request import validate as validate_request
from deepinfer_fn.errors import ArgumentError, ArgumentTypeError

TYPE, RANGE = ArgumentTypeError, ArgumentError


@functools.cache
def tiny():
    return di.init_params(di.ModelConfig.preset("tiny"), jax.random.key(0), dtype=jnp.float32)


def tokens():
    return np.arange(2, 14, dtype=np.int32).reshape(2, 6)


def raises_at_call(error, match, fn, *args, **kwargs):
    """fn(...) raises `error` matching `match` and compiles no program."""
    with di.ProgramCounter() as counter:
        with pytest.raises(error, match=match):
            fn(*args, **kwargs)
    assert counter.programs == 0, counter.names


# ------------------------------------------------------------------ the reusable checks
@pytest.mark.parametrize("check,args,error,match", [
    (V.positive_int, (True,), TYPE, r"f: n must be a positive int, got True \(bool\)"),
    (V.positive_int, (2.0,), TYPE, r"got 2.0 \(float\) \(pass a whole number"),
    (V.positive_int, (0,), RANGE, "positive int, got 0"),
    (V.non_negative_int, (-1,), RANGE, "non-negative int"),
    (V.int_in, (5, 0, 5), RANGE, r"an int in \[0, 5\), got 5"),
    (V.float_in, ("1", 0.0, 1.0), TYPE, r"a number in \[0.0, 1.0\]"),
    (V.float_in, (math.nan, 0.0, 1.0), RANGE, "finite number"),
    (V.boolean, ("yes",), TYPE, "True or False"),
    (V.one_of, ("x", ("a", "b")), RANGE, r"one of \('a', 'b'\)"),
    (V.token_ids, ([1, 300], 256), RANGE, r"n\[1\] must be an int in \[0, 256\)"),
    (V.token_ids, (3, 256), TYPE, "sequence of token ids"),
    (V.float_dtype, (jnp.int32,), TYPE, "floating dtype"),
])
def test_checks(check, args, error, match):
    with pytest.raises(error, match=match):
        check("f", "n", *args)


def test_checks_accept_and_normalize():
    assert V.positive_int("f", "n", np.int32(3)) == 3 and type(V.positive_int("f", "n", 3)) is int
    assert V.float_in("f", "x", 1, 0.0, 1.0) == 1.0
    assert V.token_ids("f", "ids", np.array([1, 2]), 4) == (1, 2)
    assert V.float_dtype("f", "d", "bfloat16") == jnp.bfloat16


# ------------------------------------------------------------------ generate / stream_generate
GENERATE_CASES = [
    (dict(max_new_tokens=True), TYPE, r"max_new_tokens must be a positive int, got True \(bool\)"),
    (dict(max_new_tokens=2.0), TYPE, "max_new_tokens must be a positive int"),
    (dict(max_new_tokens="3"), TYPE, "max_new_tokens"),
    (dict(max_new_tokens=0), RANGE, "max_new_tokens"),
    (dict(lengths=[2.5, 3.0]), TYPE, "lengths must hold ints"),
    (dict(lengths=[True, True]), TYPE, "lengths must hold ints"),
    (dict(tokens=[[1, 2, 3], [4, 5]]), RANGE, "rectangular"),
    (dict(tokens=np.zeros((2, 3), np.float32)), TYPE, "integer token ids"),
    (dict(stop_tokens=[1.5]), TYPE, "stop_tokens must hold int token ids"),
    (dict(stop_tokens=[True]), TYPE, "stop_tokens must hold int token ids"),
    (dict(stop_tokens=3), TYPE, r"stop_tokens must be a sequence .*write \[id\]"),
    (dict(stop_tokens=[256]), RANGE, "stop_tokens"),
    (dict(pad_id=256), RANGE, r"pad_id must be an int in \[0, 256\)"),
    (dict(pad_id=-1), RANGE, "pad_id"),
    (dict(pad_id=True), TYPE, "pad_id"),
    (dict(pad_id=1.5), TYPE, "pad_id"),
    (dict(prefill_chunk=0), RANGE, "prefill_chunk"),
    (dict(prefill_chunk=True), TYPE, "prefill_chunk"),
    (dict(max_len=0), RANGE, "max_len"),
    (dict(max_len=1.5), TYPE, "max_len"),
    (dict(window_slots=-4), RANGE, "window_slots"),
    (dict(top_k=True), TYPE, "top_k"),
    (dict(seed=True), TYPE, "seed"),
    (dict(temperature="hot"), TYPE, "temperature"),
    (dict(top_p=1.5), RANGE, "top_p"),
    (dict(return_logprobs="yes"), TYPE, "return_logprobs"),
    (dict(speculative="eagle"), RANGE, "speculative must be one of"),
    (dict(speculative="mtp", num_draft_tokens=0), RANGE, "num_draft_tokens"),
]


@pytest.mark.parametrize("kwargs,error,match", GENERATE_CASES)
def test_generate_rejects_at_call(kwargs, error, match):
    kwargs = {"max_new_tokens": 2, "tokens": tokens(), **kwargs}
    raises_at_call(error, match, di.generate, tiny(), kwargs.pop("tokens"), **kwargs)


@pytest.mark.parametrize("kwargs,error,match", GENERATE_CASES + [
    (dict(block=0), RANGE, "block must be a positive int"),
    (dict(block=True), TYPE, "block"),
    (dict(bogus=1), TYPE, "unexpected keyword arguments"),
])
def test_stream_generate_rejects_at_call_not_at_next(kwargs, error, match):
    kwargs = {"max_new_tokens": 2, "tokens": tokens(), **kwargs}
    # No next(): the call itself must raise.
    raises_at_call(error, match, di.stream_generate, tiny(), kwargs.pop("tokens"), **kwargs)


def test_params_must_be_params():
    raises_at_call(TYPE, "generate: model must be a deepinfer_fn.Model .* or Params", di.generate,
                   {}, tokens(), max_new_tokens=2)
    raises_at_call(TYPE, "stream_generate: model must be a deepinfer_fn.Model .* or Params",
                   di.stream_generate, {}, tokens(), max_new_tokens=2)
    with pytest.raises(TYPE, match="Engine: model must be a deepinfer_fn.Model .* or Params"):
        di.Engine({})
    raises_at_call(TYPE, "params must be deepinfer_fn.Params", di.forward, {}, tokens())


# ------------------------------------------------------------------ forward
@pytest.mark.parametrize("toks,error,match", [
    ([[1, 2, 3], [4]], RANGE, "rectangular"),
    (np.zeros((1, 4), np.float32), TYPE, "integer"),
    (np.array([[1, 256]]), RANGE, "outside the vocabulary"),
    ("abc", TYPE, "2-D int array"),
])
def test_forward_rejects_at_call(toks, error, match):
    raises_at_call(error, match, di.forward, tiny(), toks)


# ------------------------------------------------------------------ Engine / Request / state
@pytest.mark.parametrize("kwargs,error,match", [
    (dict(max_len=0), RANGE, "Engine: max_len must be a positive int"),
    (dict(max_len=-16), RANGE, "max_len"),
    (dict(max_batch=True), TYPE, "max_batch"),
    (dict(window_slots=-4), RANGE, "window_slots"),
    (dict(window_slots=2), RANGE, "window_slots=2 must be >= the model's sliding_window"),
    (dict(prefix_cache="yes"), TYPE, "prefix_cache must be True or False"),
    (dict(verify_len="sometimes"), RANGE, "verify_len"),
    (dict(num_pages=0), RANGE, "num_pages"),
    (dict(replay_tokens=-1), RANGE, "replay_tokens"),
])
def test_engine_rejects_at_construction(kwargs, error, match):
    raises_at_call(error, match, di.Engine, tiny(), **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(top_k=True), "top_k"),
    (dict(seed=True), "seed"),
    (dict(stop_tokens=[1.5]), "stop_tokens must hold int token ids"),
    (dict(stop_tokens=[True]), "stop_tokens must hold int token ids"),
    (dict(stop_tokens=7), "stop_tokens must be a sequence"),
    (dict(max_new_tokens=True), "max_new_tokens"),
])
def test_request_errors_name_the_argument(kwargs, match):
    _, error = validate_request(di.Request(tokens=[1, 2, 3], **kwargs), 256, 64, 1024)
    assert error is not None and match in error, error


def test_init_state_checks():
    cfg = di.ModelConfig.preset("tiny")
    with pytest.raises(TYPE, match="batch"):
        di.init_state(cfg, True, 64)
    with pytest.raises(TYPE, match="dtype"):
        di.init_state(cfg, 1, 64, dtype=jnp.int32)


# ------------------------------------------------------------------ load_params
def test_load_params_dtype_must_be_float(tmp_path):
    raises_at_call(TYPE, "load_params: dtype must be a floating dtype", di.load_params, tmp_path,
                   dtype=jnp.int32)
    raises_at_call(TYPE, "dtype", di.load_params, tmp_path, dtype="bool")


def test_load_params_file_instead_of_directory(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(di.ModelConfig.preset("tiny").to_hf()))
    with pytest.raises(di.CheckpointError, match=rf"is a file.*directory.*{tmp_path}"):
        di.load_params(cfg)
    with pytest.raises(di.CheckpointError, match="does not exist"):
        di.load_params(tmp_path / "nope")
    with pytest.raises(TYPE, match="path must be a checkpoint directory"):
        di.load_params(3)
    with pytest.raises(TYPE, match="include_mtp"):
        di.load_params(tmp_path, include_mtp="yes")


# ------------------------------------------------------------------ config.json, field by field
def _write(tmp_path, edit):
    raw = di.ModelConfig.preset("tiny").to_hf()
    edit(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


def _set(key, value):
    return lambda raw: raw.__setitem__(key, value)


@pytest.mark.parametrize("edit,match", [
    (_set("vocab_size", "256"), r"vocab_size must be an int, got '256' \(str\)"),
    (_set("hidden_size", None), "hidden_size must be an int, got None"),
    (_set("num_hidden_layers", "4"), "num_hidden_layers must be an int"),
    (_set("num_hidden_layers", True), "num_hidden_layers must be an int"),
    (_set("head_dim", 32.0), "head_dim must be an int"),
    (_set("rms_norm_eps", "1e-6"), "rms_norm_eps must be a number"),
    (_set("rms_norm_eps", -1.0), "rms_norm_eps must be a finite number > 0"),
    (_set("rope_theta", None), "rope_theta must be a number"),
    (_set("hc_eps", None), "hc_eps must be a number"),
    (_set("hc_mult", 0), "hc_mult must be a positive int"),
    (_set("bos_token_id", 300), r"bos_token_id=300 is outside the vocabulary \[0, 256\)"),
    (_set("eos_token_id", -1), "eos_token_id=-1 is outside the vocabulary"),
    (_set("eos_token_id", 1.5), "eos_token_id must be an int"),
    (_set("scoring_func", 3), "scoring_func must be a string"),
    (_set("compress_rates", [4, 16]), "compress_rates must be a JSON object"),
    (_set("compress_rates", {"compressed_sparse_attention": "4"}), "compress_rates.* must be an int"),
    (_set("layer_types", "sliding_attention"), "layer_types must be a list"),
    (lambda raw: raw["rope_scaling"].__setitem__("factor", "16"), "factor must be a number"),
    (_set("rope_scaling", 16), "rope_scaling must be a JSON object"),
    (_set("num_hash_layers", 1.5), "num_hash_layers must be an int"),
])
def test_config_json_fields_are_validated_at_load(tmp_path, edit, match):
    path = _write(tmp_path, edit)
    with pytest.raises(ConfigError, match=match):
        di.ModelConfig.from_hf(path)
    with pytest.raises(di.CheckpointError, match=match):   # load_params reports the same
        di.load_params(path)


def test_config_top_level_must_be_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"config.json: the top level must be a JSON object"):
        di.ModelConfig.from_hf(tmp_path)
    with pytest.raises(TYPE, match="source must be"):
        di.ModelConfig.from_hf([1, 2])


def test_model_config_fields_typed_directly():
    cfg = di.ModelConfig.preset("tiny")
    with pytest.raises(ConfigError, match="scan_layers must be True or False"):
        cfg.replace(scan_layers="yes")
    with pytest.raises(ConfigError, match="fp8_block must be a pair of ints"):
        cfg.replace(fp8_block=(128.0, 128))
    assert cfg.replace(rope_theta=10000).rope_theta == 10000   # ints are accepted for floats


def test_image_tokens_without_a_vision_tower_are_rejected():
    """V4.1 reserves an image token for image patches; with no vision tower, generate and
    stream_generate refuse it by name, and an engine request carrying it fails alone."""
    from deepinfer_fn.params import init_params
    cfg = di.ModelConfig.preset("v4.1-tiny")
    img = cfg.image_token_id
    assert 0 <= img < cfg.vocab_size
    assert V.image_token_message(img, np.array([[3, 4], [5, 6]])) is None
    assert V.image_token_message(-1, np.array([img])) is None
    msg = V.image_token_message(img, np.array([[3, 4], [5, img]]))
    assert "image token" in msg and "1, 1" in msg and "vision tower" in msg
    params = init_params(cfg, jax.random.key(0))
    toks = np.full((2, 6), 3, np.int32)
    toks[1, 4] = img
    for fn in (di.generate, di.stream_generate):
        with pytest.raises(ArgumentError, match="image token .* vision tower"):
            out = fn(params, toks, max_new_tokens=2)
            next(iter(out)) if fn is di.stream_generate else None
    with pytest.raises(ArgumentError, match="image token"):
        di.generate(params, toks, lengths=np.array([6, 5]), max_new_tokens=1)
    req = di.engine.Request([3, img, 4], max_new_tokens=2)
    prompt, err = validate_request(req, cfg.vocab_size, 64, 1024, img)
    assert prompt == [] and "image token" in err
    assert validate_request(di.engine.Request([3, 4], max_new_tokens=2), cfg.vocab_size, 64,
                            1024, img) == ([3, 4], None)
