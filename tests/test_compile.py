"""Compile once, reuse: the persistent cache default, program counts of `generate`, and
parallel precompilation reaching JAX's cache."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deepinfer_fn as di
from deepinfer_fn.compile_cache import Job, ProgramCounter, precompile
from deepinfer_fn.generate import decode_width, prefill_width, stop_array

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cache_dir_in_subprocess(env_updates: dict, tmp_path) -> str:
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COMPILATION_CACHE_DIR", "DEEPINFER_COMPILE_CACHE", "XDG_CACHE_HOME")}
    env.update(env_updates, JAX_PLATFORMS="cpu", HOME=str(tmp_path))
    code = "import deepinfer_fn, jax; print(repr(jax.config.jax_compilation_cache_dir))"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, check=True)
    return eval(out.stdout.strip().splitlines()[-1])


def test_persistent_cache_on_by_default_and_env_controls_it(tmp_path):
    assert _cache_dir_in_subprocess({}, tmp_path) == str(tmp_path / ".cache/deepinfer_fn/jax")
    assert _cache_dir_in_subprocess({"XDG_CACHE_HOME": str(tmp_path / "xdg")}, tmp_path) == \
        str(tmp_path / "xdg/deepinfer_fn/jax")
    assert _cache_dir_in_subprocess({"DEEPINFER_COMPILE_CACHE": str(tmp_path / "c")},
                                    tmp_path) == str(tmp_path / "c")
    assert _cache_dir_in_subprocess({"DEEPINFER_COMPILE_CACHE": "off"}, tmp_path) in (None, "")
    # A directory the user already gave JAX wins.
    assert _cache_dir_in_subprocess({"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "j"),
                                     "DEEPINFER_COMPILE_CACHE": str(tmp_path / "c")},
                                    tmp_path) == str(tmp_path / "j")


def test_second_process_loads_programs_from_disk(tmp_path):
    code = ("import deepinfer_fn as di, jax, jax.numpy as jnp\n"
            "f = jax.jit(lambda x: jnp.sin(x) @ x.T + 1)\n"
            "with di.ProgramCounter() as c: f(jnp.ones((8, 8))).block_until_ready()\n"
            "print(c.programs, c.disk_hits)\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", DEEPINFER_COMPILE_CACHE=str(tmp_path),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    runs = [subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split() for _ in range(2)]
    (p1, h1), (p2, h2) = [(int(a), int(b)) for a, b in runs]
    assert p1 >= 1 and h1 == 0          # first process compiles and writes the entry
    assert p2 == p1 and h2 == p2        # the second loads every program from disk
    assert any(tmp_path.iterdir())


def test_precompile_fills_jax_cache_and_runs_in_threads():
    f = jax.jit(lambda s, x, *, k: (s + jnp.tanh(x) * k, x.sum()), static_argnames=("k",),
                donate_argnums=(0,))
    sd = jax.ShapeDtypeStruct
    jobs = [Job(f, (sd((16, 16), jnp.float32), sd((16, 16), jnp.float32)), dict(k=2)),
            Job(f, (sd((4, 4), jnp.float32), sd((4, 4), jnp.float32)), dict(k=3))]
    with ProgramCounter() as c:
        secs = precompile(jobs)
    assert len(secs) == 2 and c.programs == 2
    s, x = jnp.zeros((16, 16)), jnp.ones((16, 16))
    with ProgramCounter() as c:
        out = f(s, x, k=2)
    assert c.programs == 0               # the real call found the precompiled program
    np.testing.assert_allclose(np.asarray(out[0]), 2 * np.tanh(1.0) * np.ones((16, 16)), rtol=1e-6)


def test_shape_buckets():
    assert [prefill_width(t, 512) for t in (1, 16, 17, 100, 300, 5000)] == [16, 16, 32, 128, 512, 512]
    assert prefill_width(100, 64) == 64
    assert [decode_width(n, n) for n in (1, 16, 17, 96, 200)] == [16, 16, 32, 128, 256]
    assert decode_width(96, 16) == 16
    assert stop_array(()).tolist() == [-1] * 4
    assert stop_array((5, 6, 7, 8, 9)).tolist() == [5, 6, 7, 8, 9, -1, -1, -1]


# generate on one device compiles three programs: the empty decode state, the prefill chunk and
# the decode loop (inputs go up with device_put and outputs are sliced on the host, so no
# eager op compiles); prompts of at most 16 tokens two (the decode loop feeds them). A change
# that adds programs per call must raise these knowingly.
GENERATE_PROGRAMS = 3
SHORT_PROMPT_PROGRAMS = 2


def test_generate_compiles_few_programs_and_reuses_them():
    cfg = di.ModelConfig.preset("tiny", max_position_embeddings=256)
    params = di.init_params(cfg, jax.random.key(7))
    rng = np.random.default_rng(0)
    prompt = rng.integers(2, cfg.vocab_size, (2, 11)).astype(np.int32)
    with ProgramCounter() as first:
        out = di.generate(params, prompt, max_new_tokens=5, stop_tokens=[3])
    assert out.tokens.shape == (2, 5)
    assert first.programs <= SHORT_PROMPT_PROGRAMS, first.names
    long_prompt = rng.integers(2, cfg.vocab_size, (2, 20)).astype(np.int32)
    with ProgramCounter() as longer:
        di.generate(params, long_prompt, max_new_tokens=5, stop_tokens=[3])
    assert longer.programs <= GENERATE_PROGRAMS, longer.names
    # the real call finds every precompiled program: none compiles twice
    for counter in (first, longer):
        assert len(set(counter.names)) == len(counter.names), counter.names
    # Same buckets (prompt <= 16 tokens, <= 16 new tokens, any stop list, any sampling
    # values): nothing new to compile.
    prompt2 = rng.integers(2, cfg.vocab_size, (2, 14)).astype(np.int32)
    with ProgramCounter() as again:
        out2 = di.generate(params, prompt2, max_new_tokens=9, stop_tokens=[4, 5],
                           temperature=0.7, seed=[1, 2])
    assert out2.tokens.shape == (2, 9)
    assert again.programs == 0, again
    # The bucketed program gives the tokens of an exact-width run.
    ref = di.generate(params, prompt2[:, :14], max_new_tokens=9, stop_tokens=[4, 5],
                      temperature=0.7, seed=[1, 2], prefill_chunk=14)
    np.testing.assert_array_equal(np.asarray(out2.tokens), np.asarray(ref.tokens))


@pytest.mark.heavy
def test_engine_warmup_compiles_every_shape_up_front():
    cfg = di.ModelConfig.preset("tiny", max_position_embeddings=256)
    params = di.init_params(cfg, jax.random.key(7))
    engine = di.Engine(params, max_batch=4, max_tokens_per_step=64, max_len=128, progress=False,
                       decode_buckets=(4,), prefill_shapes=((1, 32), (2, 32)))
    with ProgramCounter() as warm:
        engine.warmup()
    assert warm.programs <= 3            # one sub-step program per shape, nothing else
    rng = np.random.default_rng(0)
    requests = [rng.integers(2, 200, n).astype(np.int32) for n in (5, 20, 40)]
    with ProgramCounter() as run:
        outs = engine.generate(requests, max_new_tokens=6)
    assert run.programs == 0, run.names
    assert [len(o.tokens) for o in outs] == [6, 6, 6]
