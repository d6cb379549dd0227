"""Command line (`python -m deepinfer_fn`): generate (raw prompt, sampled as the README's main
job, greedy, chat), info, forward, precompile, --model resolution (directory, preset, hub id),
--dtype, --quiet, and one-line errors with exit status 2 (bad argument) or 1 (library error),
never a traceback unless DEEPINFER_DEBUG=1.

Oracles: `di.generate` / `di.forward` / `di.count_params` in this process and the tokenizer's
own decoding. The subprocesses share the test compilation cache; argument errors that need no
device run in-process through `main(argv)` (the same entry point), a few through the
interpreter too. Each subprocess costs a JAX import and a model load, so they are few.
"""

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deepinfer_fn as di
from deepinfer_fn import text
from deepinfer_fn.__main__ import main
from test_engine import params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 3
PROMPT = "The cat"


def cli(*argv, env=None):
    """(returncode, stdout, stderr) of `python -m deepinfer_fn *argv` in a fresh process."""
    full = {k: v for k, v in os.environ.items() if k != "DEEPINFER_DEBUG"}
    full.update({"JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1",
                 "JAX_COMPILATION_CACHE_DIR": os.path.join(ROOT, ".jax_cache"),
                 "XLA_FLAGS": "--xla_backend_optimization_level=0", **(env or {})})
    r = subprocess.run([sys.executable, "-m", "deepinfer_fn", *argv], cwd=ROOT, env=full,
                       capture_output=True, text=True, timeout=300)
    return r.returncode, r.stdout, r.stderr


@functools.cache
def tokenizer():
    return text.load_tokenizer(di.default_model_path())


def expected_text(ids: list[int], **sampling) -> str:
    """Continuation of `ids` by generate() (greedy unless `sampling`), decoded, EOS dropped."""
    tok = tokenizer()
    out = di.generate(params(), np.asarray([ids], np.int32), max_new_tokens=N,
                      stop_tokens=[tok.eos_id], **sampling)
    new = [t for t in np.asarray(out.tokens)[0, :int(out.lengths[0])].tolist() if t != tok.eos_id]
    return tok.decode(new)


def raw_ids(prompt: str) -> list[int]:
    tok = tokenizer()
    return ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(prompt)


def test_generate_raw_sampled_quiet_prints_only_the_text():
    """The README's main job (temperature 0.7, top-p 0.95) with a seed and --quiet: stdout is
    exactly generate()'s sampled tokens with the same seed, decoded (the CLI streams in blocks;
    the draws are keyed by seed and position, so they agree); stderr is empty (no model line,
    no progress bar, no summary)."""
    sampling = dict(temperature=0.7, top_p=0.95, seed=5)
    rc, out, err = cli("generate", "--prompt", PROMPT, "--max-new-tokens", str(N),
                       "--temperature", "0.7", "--top-p", "0.95", "--seed", "5", "--quiet")
    assert rc == 0, err
    assert err == ""
    assert out == expected_text(raw_ids(PROMPT), **sampling) + "\n"


@pytest.mark.heavy
def test_generate_chat_and_default_output():
    """Chat mode renders the prompt as a user turn (the tokenizer's template); without --quiet
    the raw prompt is echoed and stderr names the model and ends with the summary line."""
    tok = tokenizer()
    ids = tok.apply_chat([{"role": "user", "content": PROMPT}], thinking=False)
    rc, out, err = cli("generate", "--chat", "--prompt", PROMPT, "--max-new-tokens", str(N),
                       "--quiet")
    assert rc == 0, err
    assert out == expected_text(ids) + "\n" and err == ""
    rc, out, err = cli("generate", "--prompt", PROMPT, "--max-new-tokens", str(N),
                       "--model", di.default_model_path())
    assert rc == 0, err
    assert out == PROMPT + expected_text(raw_ids(PROMPT)) + "\n"     # greedy, prompt echoed
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines[0] == f"model: checkpoint directory {di.default_model_path()}"
    assert lines[-1].startswith("[prompt ") and f"{N} new tokens" in lines[-1]


def test_info_preset_directory_and_hub_id(tmp_path):
    """info on a preset, a checkpoint directory (--quiet: stdout only) and a hub id resolved
    from the hub cache (a fake cache holding the embedded model): counts equal count_params of
    the config, the layer schedule its layer_types."""
    rc, out, err = cli("info", "--model", "tiny")
    assert rc == 0, err
    tiny = di.ModelConfig.preset("tiny")
    assert json.loads(out) == {"model": "tiny", **di.count_params(tiny), "layers": {
        t: tiny.layer_types.count(t) for t in set(tiny.layer_types)}}
    assert err.strip() == "model: preset 'tiny'"
    rc, out, err = cli("info", "--model", di.default_model_path(), "--quiet")
    assert rc == 0 and err == "", err
    want = di.count_params(di.ModelConfig.from_hf(di.default_model_path()))
    assert {k: json.loads(out)[k] for k in want} == want
    snap = tmp_path / "hub" / "models--org--tiny-v4" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("abc123")
    (snap / "config.json").symlink_to(os.path.join(di.default_model_path(), "config.json"))
    rc, out, err = cli("info", "--model", "org/tiny-v4",
                       env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert rc == 0, err
    want = di.count_params(di.ModelConfig.from_hf(di.default_model_path()))
    assert json.loads(out)["total"] == want["total"]
    assert err.strip() == f"model: hub id org/tiny-v4 (snapshot {snap})"


def test_forward_and_precompile_help():
    """forward on the tiny preset (seed-0 random weights, said on stderr) and on the default
    model's directory in bfloat16 (--quiet) prints forward()'s per-position argmax of the same
    weights; precompile --help exits 0."""
    rc, out, err = cli("forward", "--model", "tiny", "--tokens", "1,2,3")
    assert rc == 0, err
    p = di.init_params(di.ModelConfig.preset("tiny"), jax.random.key(0))
    want = np.asarray(di.forward(p, np.array([[1, 2, 3]], np.int32)))[0].argmax(-1).tolist()
    assert out == f"next-token argmax per position: {want}\n"
    assert err.splitlines()[0] == "model: preset 'tiny' with random weights (not a trained model)"
    ids = raw_ids(PROMPT)
    rc, out, err = cli("forward", "--model", di.default_model_path(), "--dtype", "bfloat16",
                       "--tokens", ",".join(map(str, ids)), "--quiet")
    assert rc == 0 and err == "", err
    p16 = di.load_params(di.default_model_path(), dtype=jnp.bfloat16)
    want = np.asarray(di.forward(p16, np.array([ids], np.int32)))[0].argmax(-1).tolist()
    assert out == f"next-token argmax per position: {want}\n"
    rc, out, err = cli("precompile", "--help")
    assert rc == 0 and out.startswith("usage:") and "--max-batch" in out


BAD = [  # (argv, exit status, words the one line must contain)
    (["generate", "--prompt", "x", "--max-new-tokens", "-1"], 2, "--max-new-tokens"),
    (["generate", "--prompt", "x", "--max-new-tokens", "two"], 2, "positive integer"),
    (["generate", "--prompt", "x", "--temperature", "-0.5"], 2, "--temperature"),
    (["generate", "--prompt", "x", "--temperature", "inf"], 2, "finite"),
    (["generate", "--prompt", "x", "--top-p", "0"], 2, "(0, 1]"),
    (["generate", "--prompt", "x", "--top-p", "1.5"], 2, "--top-p"),
    (["generate", "--prompt", "x", "--min-p", "1"], 2, "[0, 1)"),
    (["generate", "--prompt", "x", "--top-k", "-2"], 2, "--top-k"),
    (["generate", "--prompt", "x", "--seed", str(2**32)], 2, "--seed"),
    (["generate", "--prompt", "x", "--block", "0"], 2, "--block"),
    (["generate", "--prompt", "x", "--dtype", "float16"], 2, "--dtype"),
    (["generate"], 2, "--prompt"),
    (["generate", "--prompt", "x", "--model", "tiny"], 2, "tokenizer"),
    (["generate", "--prompt", "x", "--model", "README.md"], 2, "is a file"),
    (["generate", "--prompt", "x", "--top-k", "1.5"], 2, "--top-k"),
    (["generate", "--prompt", "x", "--bogus"], 2, "unrecognized arguments"),
    (["frobnicate"], 2, "invalid choice"),
    ([], 2, "required"),
    (["info", "--model", "/no/such/dir"], 2, "no such directory"),
    (["info", "--model", "./no-such-dir"], 2, "no such directory"),
    (["info", "--model", "no-such-preset"], 2, "tiny"),
    (["info", "--model", "README.md"], 2, "is a file"),
    (["info", "--model", ""], 2, "not a directory, a preset"),
    (["info", "--model", "no-such-org/no-such-model"], 2, "not in the Hugging Face cache"),
    (["forward", "--tokens", "1,x"], 2, "--tokens"),
    (["forward", "--tokens", "1,-3"], 2, "--tokens"),
    (["forward", "--tokens", ""], 2, "--tokens"),
    (["forward", "--dtype", "int8"], 2, "--dtype"),
    (["forward", "--tokens", "1,256"], 2, "vocabulary"),
    (["precompile", "--batch", "0"], 2, "--batch"),
    (["precompile", "--max-batch", "-4"], 2, "--max-batch"),
    (["precompile", "--prompt-len", "0,8"], 2, "--prompt-len"),
    (["generate", "--prompt", "x", "--max-new-tokens", "100000", "--quiet"], 1, "context"),
]


@pytest.mark.parametrize("argv,code,words", BAD, ids=[" ".join(a) or "(none)" for a, _, _ in BAD])
def test_bad_arguments_one_line(argv, code, words, capsys, monkeypatch):
    """Every bad argument: exactly one stderr line naming the problem (no traceback), nothing
    on stdout, exit status 2 (a bad argument) or 1 (the library refused the call)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("DEEPINFER_DEBUG", raising=False)
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == code
    assert out == "" and err.count("\n") == 1 and err.endswith("\n"), err
    assert " error: " in err and words in err, err
    assert "Traceback" not in err


def test_errors_through_the_interpreter(tmp_path):
    """The same through `python -m`: a bad value and a library error (a directory without
    config.json) each print one line with their exit status; DEEPINFER_DEBUG=1 re-raises
    with the traceback."""
    rc, out, err = cli("generate", "--prompt", "x", "--max-new-tokens", "-1")
    assert rc == 2 and out == "" and err.count("\n") == 1 and "--max-new-tokens" in err
    assert "Traceback" not in err
    rc, out, err = cli("info", "--model", str(tmp_path))
    assert rc == 1 and out == "" and err.count("\n") == 1
    assert "ConfigError" in err and "config.json" in err and "Traceback" not in err
    rc, out, err = cli("info", "--model", str(tmp_path), env={"DEEPINFER_DEBUG": "1"})
    assert rc == 1 and "Traceback" in err and err.count("\n") > 3
