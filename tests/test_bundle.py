"""The model bundle (deepinfer_fn.bundle): `load_model` from the embedded default model, a
directory, DEEPINFER_MODEL_PATH and a Hugging Face hub cache built here (offline); `unpack`;
the bundle's tokenizer and drafter against the files read independently; generation through
the bundle's pieces."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
import tokenizers
from safetensors.numpy import load_file

import deepinfer_fn as di
from deepinfer_fn import bundle, speculative as spec, text
from deepinfer_fn.errors import ArgumentError, ArgumentTypeError

COMMIT = "0123456789abcdef0123456789abcdef01234567"
N = 16                                   # new tokens: one max_new_tokens bucket for every call
PROMPT = "import os\n\n\ndef main("
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def model():
    return di.load_model()


@pytest.fixture(scope="module")
def prompt(model):
    return np.asarray([model.tokenizer.encode(PROMPT)], np.int32)


def _leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) and len(la) > 0
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _copy_model(dst, *, dspark=True):
    """The default model's files under `dst` (symlinked, as the hub cache links its blobs)."""
    src = di.default_model_path()
    skip = ["training_log.json", "sts_log.npz"] + ([] if dspark else ["dspark"])
    shutil.copytree(src, dst, copy_function=os.symlink, ignore=shutil.ignore_patterns(*skip))
    return str(dst)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A hub cache holding `org/name` (refs/main -> COMMIT), HF_HUB_CACHE pointing at it."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--name"
    _copy_model(repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.delenv(bundle.MODEL_PATH_ENV, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


# ------------------------------------------------------------------------------ loading
def test_default_bundle(model, monkeypatch):
    path = di.default_model_path()
    assert model.path == path and model.config == di.ModelConfig.from_hf(path)
    assert model.speculative == ("mtp", "dspark") and model.chat_encoding == "deepseek_v4"
    # the weights: the loader's, and the stored bf16 tensor itself
    _leaves_equal(model.params, di.load_params(path))
    raw = load_file(os.path.join(path, "model.safetensors"))["embed.weight"]
    np.testing.assert_array_equal(np.asarray(model.params["embed"]), raw.astype(np.float32))
    monkeypatch.delenv(bundle.MODEL_PATH_ENV, raising=False)
    again = di.load_model(path, dtype="bfloat16", drafter=False)
    assert again.path == path and again.drafter is None and again.speculative == ("mtp",)
    assert again.params.dtype == jnp.bfloat16 and "dspark" in repr(model)


def test_drafter_is_the_dspark_tests_drafter(model):
    """The bundle's drafter equals `load_dspark(default_dspark_path(), params)` (what
    tests/test_dspark.py loads) and the files read without the loader."""
    expected = spec.load_dspark(spec.default_dspark_path(), model.params)
    assert model.drafter.config == expected.config
    _leaves_equal(model.drafter, expected)
    folder = os.path.join(di.default_model_path(), "dspark")
    with open(os.path.join(folder, "dspark_config.json")) as f:
        temps = json.load(f)["sts_temperatures"]
    np.testing.assert_allclose(np.asarray(model.drafter.sts_temperatures), temps, rtol=1e-6)
    raw = load_file(os.path.join(folder, "dspark.safetensors"))["confidence"]
    np.testing.assert_array_equal(np.asarray(model.drafter["confidence"], np.float32),
                                  raw.astype(np.float32))


def test_tokenizer_round_trips(model):
    tok = model.tokenizer
    assert isinstance(tok, text.Tokenizer) and tok.vocab_size == model.config.vocab_size
    raw = tokenizers.Tokenizer.from_file(os.path.join(model.path, "tokenizer.json"))
    for s in (PROMPT, "x = {'a': [1, 2.5]}  # ünïcode\n", ""):
        ids = tok.encode(s)
        assert ids == raw.encode(s, add_special_tokens=False).ids
        assert tok.decode(ids) == s
    assert tok.eos_id == model.config.eos_token_id


def test_model_path_env_overrides_the_default(tmp_path, monkeypatch):
    copy = _copy_model(tmp_path / "m", dspark=False)
    monkeypatch.setenv(bundle.MODEL_PATH_ENV, copy)
    m = di.load_model()
    assert m.path == copy and m.source == copy and m.drafter is None
    assert m.speculative == ("mtp",)
    assert di.load_model(di.default_model_path()).drafter is not None   # an argument wins
    monkeypatch.setenv(bundle.MODEL_PATH_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(di.CheckpointError, match="DEEPINFER_MODEL_PATH=.*no such directory"):
        di.load_model()


def test_hub_id_resolves_through_the_cache(hub_cache, monkeypatch):
    snapshot = str(hub_cache / "models--org--name" / "snapshots" / COMMIT)
    assert bundle.resolve_source("org/name") == snapshot
    assert bundle.resolve_source("org/name", revision=COMMIT) == snapshot
    m = di.load_model("org/name")
    assert m.path == snapshot and m.source == "org/name" and m.speculative == ("mtp", "dspark")
    _leaves_equal(m.params, di.load_params(di.default_model_path()))
    assert m.tokenizer.encode(PROMPT) == text.load_tokenizer(di.default_model_path()).encode(PROMPT)
    # HF_HOME/hub when HF_HUB_CACHE is unset; DEEPINFER_MODEL_PATH may name a hub id
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    home = hub_cache.parent / "home"
    home.mkdir()
    (home / "hub").symlink_to(hub_cache)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv(bundle.MODEL_PATH_ENV, "org/name")
    assert bundle.hub_cache_dir() == str(home / "hub")
    assert os.path.samefile(bundle.resolve_source(), snapshot)


def test_missing_hub_id_offline(hub_cache, monkeypatch):
    with pytest.raises(di.CheckpointError,
                       match=r"org/other is not in the Hugging Face cache .*HF_HUB_OFFLINE"):
        di.load_model("org/other")
    with pytest.raises(di.CheckpointError, match="org/name@main2 is not in"):
        bundle.resolve_source("org/name", revision="main2")
    # online but unreachable (the library's own offline switch refuses every request)
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with pytest.raises(di.CheckpointError, match="org/other: not in the cache .*download failed"):
        di.load_model("org/other")
    with pytest.raises(di.CheckpointError, match="no such directory, and not a hub id"):
        di.load_model("./org/name")


def test_bad_arguments(model, tmp_path):
    tiny = di.init_params(di.ModelConfig.preset("tiny"), jax.random.key(0))
    raw = tokenizers.Tokenizer.from_file(os.path.join(model.path, "tokenizer.json"))
    cases = [
        (lambda: di.load_model(3), ArgumentTypeError, "source must be"),
        (lambda: di.load_model(b"dir"), ArgumentTypeError, "source must be"),
        (lambda: di.load_model(drafter=1), ArgumentTypeError, "drafter must be"),
        (lambda: di.load_model(progress="yes"), ArgumentTypeError, "progress"),
        (lambda: di.load_model(dtype=jnp.int8), ArgumentTypeError, "dtype must be a floating"),
        (lambda: di.load_model(os.path.join(model.path, "config.json")), di.CheckpointError,
         "is a file"),
        (lambda: di.load_model(drafter=str(tmp_path)), spec.DSparkError, "lacks"),
        (lambda: bundle.unpack("params"), ArgumentTypeError, "model must be a deepinfer_fn.Model"),
        (lambda: bundle.unpack(model, tokenizer=raw), ArgumentTypeError, "wrap a tokenizers"),
        (lambda: di.Model(model), ArgumentTypeError, "params must be"),
        (lambda: di.Model(model.params, drafter=model.params), ArgumentTypeError, "drafter must"),
        (lambda: di.Model(tiny, drafter=model.drafter), spec.DSparkError, "another target"),
        (lambda: di.Model(tiny, tokenizer=model.tokenizer), ArgumentError,   # 4096 ids > 256
         "belongs to another model"),
        (lambda: di.Model(model.params, path=1), ArgumentTypeError, "path must be"),
    ]
    for call, kind, message in cases:
        with pytest.raises(kind, match=message):
            call()


def test_unpack(model):
    params, drafter, tok = bundle.unpack(model)
    assert params is model.params and drafter is None and tok is model.tokenizer
    assert bundle.unpack(model, speculative="mtp")[1] is None
    assert bundle.unpack(model, speculative="dspark")[1] is model.drafter
    other_tok = text.load_tokenizer(model.path)
    other = spec.load_dspark(spec.default_dspark_path(), model.params, jnp.bfloat16)
    _, d, t = bundle.unpack(model, speculative="dspark", drafter=other, tokenizer=other_tok)
    assert d is other and t is other_tok                            # explicit arguments win
    assert bundle.unpack(model.params) == (model.params, None, None)
    assert bundle.unpack(model.params, drafter=other, tokenizer=other_tok)[1:] == (other, other_tok)
    bare = di.Model(model.params)
    assert bare.tokenizer is None and bare.chat_encoding is None and bare.speculative == ("mtp",)
    with pytest.raises(ArgumentError, match="generate: speculative='dspark' but .* no DSpark"):
        bundle.unpack(bare, speculative="dspark", where="generate")
    # the tokenizer a constraint compiles against
    assert bundle.constraint_tokenizer(params, tok) is tok
    with pytest.raises(ArgumentError, match="constraint= needs the model's tokenizer"):
        bundle.constraint_tokenizer(params)


# ------------------------------------------------------------------------------ generation
def test_constraint_with_the_bundle_tokenizer(model, prompt):
    """The bundle's tokenizer is what structured output needs for this 4096-id model: the
    output is complete JSON that the schema (checked by jsonschema) accepts."""
    params, _, tok = bundle.unpack(model)
    out = di.generate(params, prompt, max_new_tokens=N, constraint=di.JsonSchema(SCHEMA),
                      tokenizer=bundle.constraint_tokenizer(params, tok))
    assert out.constraint_status == ("complete",), out.constraint_status
    ids = [t for t in np.asarray(out.tokens[0, :int(out.lengths[0])]).tolist() if t != tok.eos_id]
    jsonschema.validate(json.loads(tok.decode(ids)), SCHEMA)


@pytest.mark.heavy   # the DSpark decode loop's compile (~1 min on 2 cores)
def test_dspark_from_the_bundle_is_lossless(model, prompt):
    """The bundle's drafter through today's explicit call: greedy DSpark = plain greedy."""
    params, drafter, _ = bundle.unpack(model, speculative="dspark")
    plain = di.generate(params, prompt, max_new_tokens=N)
    out = di.generate(params, prompt, max_new_tokens=N, speculative="dspark", drafter=drafter)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
    assert out.acceptance()["steps"] > 0


def test_generate_takes_the_bundle(model, prompt):
    """`generate(model, ...)`: constraint= needs no tokenizer (the bundle's is used) and gives
    what the explicit call gives (the same compiled program as the test above)."""
    params, _, tok = bundle.unpack(model)
    constrained = di.generate(model, prompt, max_new_tokens=N, constraint=di.JsonSchema(SCHEMA))
    explicit = di.generate(params, prompt, max_new_tokens=N, constraint=di.JsonSchema(SCHEMA),
                           tokenizer=tok)
    assert constrained.constraint_status == ("complete",)
    np.testing.assert_array_equal(np.asarray(constrained.tokens), np.asarray(explicit.tokens))


@pytest.mark.heavy   # the plain, streamed, DSpark and engine programs' compiles (~2 min)
def test_everything_takes_the_bundle(model, prompt):
    """`generate(model)`, `stream_generate(model, constraint=)`, `generate(model,
    speculative="dspark")` and `Engine(model, ...)` need no drafter= / tokenizer=: greedy
    DSpark and the engine give the plain greedy tokens, the stream the one-call tokens."""
    params, _, tok = bundle.unpack(model)
    plain = di.generate(params, prompt, max_new_tokens=N)
    np.testing.assert_array_equal(np.asarray(di.generate(model, prompt, max_new_tokens=N).tokens),
                                  np.asarray(plain.tokens))
    out = di.generate(model, prompt, max_new_tokens=N, speculative="dspark")
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
    explicit = di.generate(params, prompt, max_new_tokens=N, constraint=di.JsonSchema(SCHEMA),
                           tokenizer=tok)
    (piece,) = di.stream_generate(model, prompt, max_new_tokens=N, block=N,
                                  constraint=di.JsonSchema(SCHEMA))
    np.testing.assert_array_equal(np.asarray(piece.tokens), np.asarray(explicit.tokens))
    got = di.Engine(model, max_batch=2, speculative="dspark").generate([prompt[0]],
                                                                      max_new_tokens=N)
    np.testing.assert_array_equal(np.asarray(got[0].tokens), np.asarray(plain.tokens[0]))
    (done,) = di.Engine(model, max_batch=2).generate(
        [di.Request(prompt[0], max_new_tokens=N, constraint=di.JsonSchema(SCHEMA))])
    assert done.constraint_status == "complete", done.error
    ids = [t for t in done.tokens if t != tok.eos_id]
    jsonschema.validate(json.loads(tok.decode(ids)), SCHEMA)
