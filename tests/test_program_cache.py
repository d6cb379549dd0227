"""Whole compiled programs on disk (`program_cache`): a second process runs `generate` without
tracing or compiling anything, with the same tokens; keys separate what must differ."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_fn import kernel_registry, program_cache
from deepinfer_fn.compile_cache import Job, ProgramCounter, precompile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GENERATE_IN_A_PROCESS = r"""
import json, sys
from jax import monitoring
traced = []
monitoring.register_event_duration_secs_listener(
    lambda event, secs, fun_name="", **_: traced.append(fun_name)
    if event == "/jax/core/compile/jaxpr_trace_duration" else None)
import jax, numpy as np
import deepinfer_fn as di
from deepinfer_fn import program_cache
cfg = di.ModelConfig.preset("tiny", max_position_embeddings=256)
params = di.init_params(cfg, jax.random.key(7))
prompt = np.random.default_rng(0).integers(2, cfg.vocab_size, (2, 20)).astype(np.int32)
traced.clear()
with di.ProgramCounter() as c:
    chunks = [np.asarray(o.tokens).tolist() for o in
              di.stream_generate(params, prompt, max_new_tokens=12, block=4, temperature=0.8)]
s = program_cache.stats
print(json.dumps(dict(tokens=chunks, loaded=s.loaded, compiled=s.compiled, stored=s.stored,
                      programs=c.programs, disk_hits=c.disk_hits, traced=traced)))
"""


def _run(code: str, cache, **env_updates) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COMPILATION_CACHE_DIR", program_cache.ENV_VAR)}
    env.update(JAX_PLATFORMS="cpu", DEEPINFER_COMPILE_CACHE=str(cache), **env_updates)
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.heavy
def test_second_process_runs_generate_without_tracing(tmp_path):
    first = _run(GENERATE_IN_A_PROCESS, tmp_path)
    # the empty state, the prefill chunk, the decode block (every block of the stream); the
    # prompt is longer than the loop prefill's 16 tokens, so the prefill program runs
    assert first["compiled"] == first["stored"] == 3 and first["loaded"] == 0
    assert len(list((tmp_path / program_cache.SUBDIR).iterdir())) == 3
    second = _run(GENERATE_IN_A_PROCESS, tmp_path)
    assert second["tokens"] == first["tokens"]
    assert second["loaded"] == 3 and second["compiled"] == second["stored"] == 0
    assert second["programs"] == second["disk_hits"] == 3
    names = ("init_state", "prefill_forward", "decode_block")
    assert not [n for n in second["traced"] if n in names], second["traced"]
    assert [n for n in first["traced"] if n in names]           # the oracle sees tracing
    # the program cache off: plain jit, which traces again (its persistent cache still hits)
    off = _run(GENERATE_IN_A_PROCESS, tmp_path, DEEPINFER_PROGRAM_CACHE="off")
    assert off["tokens"] == first["tokens"] and off["loaded"] == off["compiled"] == 0
    assert [n for n in off["traced"] if n in names]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    old = jax.config.jax_compilation_cache_dir
    monkeypatch.delenv(program_cache.ENV_VAR, raising=False)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    yield tmp_path / program_cache.SUBDIR
    jax.config.update("jax_compilation_cache_dir", old)
    program_cache.clear_memory()


def _entries(folder) -> int:
    return len(list(folder.glob("*.bin"))) if folder.exists() else 0


def _fresh(fun, **kw) -> program_cache.Program:
    """A Program whose in-memory executables start empty, as in a new process."""
    prog = program_cache.Program(fun, **kw)
    prog._memory.clear()
    return prog


def _scale(x, y, *, k: int, mode: str = "add"):
    return (x * k + y) if mode == "add" else (x * k - y)


def test_keys_separate_static_values_shapes_dtypes_and_kernels(cache_dir, monkeypatch):
    prog = _fresh(_scale, static_argnames=("k", "mode"), name="scale")
    x = jnp.ones((4,))
    before, store_s = program_cache.stats.compiled, program_cache.stats.store_seconds
    assert float(prog(x, x, k=2)[0]) == 3.0
    assert float(prog(x, x, k=3)[0]) == 4.0                 # static value
    assert float(prog(x, x, k=3, mode="sub")[0]) == 2.0     # static string
    prog(jnp.ones((5,)), jnp.ones((5,)), k=2)               # shape
    prog(jnp.ones((4,), jnp.bfloat16), x, k=2)              # dtype
    prog(x, np.ones((4,), np.float32), k=2)                 # numpy = default device: same key
    prog(x, y=x, k=2)                                       # keyword: a different in-tree
    assert program_cache.stats.compiled - before == 6 == _entries(cache_dir)
    assert program_cache.stats.store_seconds > store_s      # the writes are timed
    # the environment part: kernel choices and DEEPINFER_ variables
    base = program_cache.environment_key()
    other = next(i for i in kernel_registry.implementations("grouped_matmul")
                 if i != kernel_registry.choose("grouped_matmul"))
    with kernel_registry.use("grouped_matmul", other):           # a forced kernel choice
        assert ("grouped_matmul", other) in kernel_registry.selection()
        assert program_cache.environment_key() != base
    assert program_cache.environment_key() == base
    monkeypatch.setenv("DEEPINFER_KERNELS", "linear=xla")
    env = program_cache.environment_key()
    assert base != env and "DEEPINFER_KERNELS" in env
    assert program_cache.source_digest() in base


def test_second_program_object_loads_from_disk_and_donation_holds(cache_dir):
    def step(state, x):
        return state + x, state.sum()

    a = _fresh(step, donate_argnums=(0,), name="step")
    s0 = jnp.arange(4.0)
    s1, total = a(s0, jnp.ones((4,)))
    assert _entries(cache_dir) == 1 and float(total) == 6.0
    loaded = program_cache.stats.loaded
    b = _fresh(step, donate_argnums=(0,), name="step")      # as a new process would
    with ProgramCounter() as c:
        s2, total2 = b(s1, jnp.ones((4,)))
    assert program_cache.stats.loaded == loaded + 1 and c.programs == c.disk_hits == 1
    np.testing.assert_array_equal(np.asarray(s2), np.arange(4.0) + 2)
    assert float(total2) == 10.0
    if jax.default_backend() != "cpu":                     # XLA:CPU ignores donation
        assert s1.is_deleted()


def test_bad_entries_unkeyable_statics_and_tracers_fall_back(cache_dir):
    prog = _fresh(_scale, static_argnames=("k", "mode"), name="scale")
    x = jnp.ones((3,))
    prog(x, x, k=2)
    (entry,) = cache_dir.glob("*.bin")
    entry.write_bytes(b"truncated")                        # a damaged file: compile again
    again = _fresh(_scale, static_argnames=("k", "mode"), name="scale")
    compiled = program_cache.stats.compiled
    assert float(again(x, x, k=2)[0]) == 3.0
    assert program_cache.stats.compiled == compiled + 1 and entry.stat().st_size > 100

    class Opaque:                                          # no faithful text: plain jit
        def __hash__(self):
            return 1

        def __eq__(self, other):
            return isinstance(other, Opaque)

    weird = _fresh(lambda x, *, k: x * 2, static_argnames=("k",), name="weird")
    assert float(weird(x, k=Opaque())[0]) == 2.0 and _entries(cache_dir) == 1
    # inside another trace: the Program is inlined like jit
    outer = jax.jit(lambda x: prog(x, x, k=4) * 2)
    assert float(outer(x)[0]) == 10.0 and _entries(cache_dir) == 1


def test_precompile_loads_or_compiles_programs(cache_dir):
    sd = jax.ShapeDtypeStruct
    prog = _fresh(_scale, static_argnames=("k", "mode"), name="scale")
    jobs = [Job(prog, (sd((8,), jnp.float32), sd((8,), jnp.float32)), dict(k=k))
            for k in (2, 3)]
    with ProgramCounter() as c:
        precompile(jobs)
    assert c.programs == 2 and c.disk_hits == 0 and _entries(cache_dir) == 2
    ones = jnp.ones((8,))
    with ProgramCounter() as c:
        out = prog(ones, ones, k=3)                         # the precompiled executable
    assert c.programs == 0 and float(out[0]) == 4.0
    fresh = _fresh(_scale, static_argnames=("k", "mode"), name="scale")
    with ProgramCounter() as c:
        precompile([Job(fresh, job.args, job.kwargs) for job in jobs])
    assert c.programs == c.disk_hits == 2


def test_off_means_plain_jit(cache_dir, monkeypatch):
    monkeypatch.setenv(program_cache.ENV_VAR, "off")
    prog = _fresh(_scale, static_argnames=("k", "mode"), name="scale")
    assert program_cache.cache_dir() is None
    assert float(prog(jnp.ones((2,)), jnp.ones((2,)), k=5)[0]) == 6.0
    assert _entries(cache_dir) == 0 and not prog._memory


def test_executables_from_jax_cache_store_only_where_they_reload(cache_dir):
    """A compile that JAX's persistent cache answered is stored only on platforms that can
    serialize such an executable again; whatever is stored loads and runs."""
    def body(x):
        return jax.lax.fori_loop(0, 5, lambda i, c: c + jnp.sin(c * i) @ jnp.cos(c), x)

    x = jnp.ones((32, 32))
    old = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    try:
        want = np.asarray(jax.jit(body)(x))                # JAX's cache written
        _fresh(body, name="body")(x)                       # this process's executable: stored
        for entry in cache_dir.glob("*.bin"):
            entry.unlink()
        jax.clear_caches()
        hits = program_cache._thread_hits()
        np.testing.assert_allclose(np.asarray(_fresh(body, name="body")(x)), want, rtol=1e-6)
        assert program_cache._thread_hits() == hits + 1    # JAX's cache answered
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", old)
    stored = _entries(cache_dir)
    assert stored == (jax.default_backend() not in program_cache.RESERIALIZE_BROKEN)
    loaded = program_cache.stats.loaded
    np.testing.assert_allclose(np.asarray(_fresh(body, name="body")(x)), want, rtol=1e-6)
    assert program_cache.stats.loaded == loaded + stored


ENGINE_IN_A_PROCESS = r"""
import json
import jax, numpy as np
import deepinfer_fn as di
from deepinfer_fn import program_cache
cfg = di.ModelConfig.preset("tiny", max_position_embeddings=256)
params = di.init_params(cfg, jax.random.key(7))
engine = di.Engine(params, max_batch=4, max_tokens_per_step=64, max_len=128, progress=False,
                   decode_buckets=(4,), prefill_shapes=((1, 32), (2, 32)))
with di.ProgramCounter() as warm:
    engine.warmup()
rng = np.random.default_rng(0)
reqs = [di.Request(rng.integers(2, 200, n).tolist(), max_new_tokens=6, temperature=0.8,
                   request_id=i) for i, n in enumerate((5, 20, 40))]
with di.ProgramCounter() as run:
    outs = engine.generate(reqs)
s = program_cache.stats
print(json.dumps(dict(tokens=[list(map(int, o.tokens)) for o in outs], loaded=s.loaded,
                      compiled=s.compiled, warm=warm.programs, warm_hits=warm.disk_hits,
                      run=run.programs)))
"""


@pytest.mark.heavy
def test_second_engine_process_warms_up_from_stored_programs(tmp_path):
    first = _run(ENGINE_IN_A_PROCESS, tmp_path)
    assert first["compiled"] >= 3 and first["loaded"] == 0 and first["run"] == 0
    second = _run(ENGINE_IN_A_PROCESS, tmp_path)
    assert second["tokens"] == first["tokens"]
    assert second["compiled"] == 0 and second["loaded"] == first["compiled"]
    assert second["warm"] == second["warm_hits"] == second["loaded"] and second["run"] == 0


@pytest.mark.parametrize("cached", [True, False])
def test_quick_compile_options_reach_xla_for_small_calls_only(cached, tmp_path, monkeypatch):
    """Small calls compile with QUICK_COMPILE_OPTIONS, others with XLA's defaults. An option
    XLA rejects proves where the options go; `$DEEPINFER_QUICK_COMPILE=off` turns it off."""
    old = jax.config.jax_compilation_cache_dir
    monkeypatch.delenv(program_cache.ENV_VAR, raising=False)
    monkeypatch.delenv(program_cache.QUICK_COMPILE_ENV, raising=False)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path) if cached else None)
    monkeypatch.setattr(program_cache, "QUICK_COMPILE_OPTIONS", {"xla_no_such_option": 1})
    try:
        prog = _fresh(lambda x: x * 2, name="double",
                      quick_compile=lambda x: x.shape[0] <= 4)
        assert (program_cache.cache_dir() is not None) == cached
        big, small = jnp.ones((8,)), jnp.ones((4,))
        assert prog.jit_for(big) is prog.jitted and prog.jit_for(small) is prog.quick_jitted
        assert float(prog(big).sum()) == 16.0
        with pytest.raises(Exception, match="xla_no_such_option"):
            prog(small)
        with pytest.raises(Exception, match="xla_no_such_option"):
            finish = prog.stage(jax.ShapeDtypeStruct((3,), jnp.float32))
            finish()
        monkeypatch.setenv(program_cache.QUICK_COMPILE_ENV, "off")
        assert prog.jit_for(small) is prog.jitted
        assert float(prog(small).sum()) == 8.0
    finally:
        jax.config.update("jax_compilation_cache_dir", old)
        program_cache.clear_memory()


def test_generate_prefill_of_a_short_prompt_is_a_quick_compile():
    from deepinfer_fn.decoding import prefill
    sd = jax.ShapeDtypeStruct
    small = sd((1, 16), jnp.int32)
    big = sd((1, 2 * prefill.QUICK_COMPILE_MAX_TOKENS), jnp.int32)
    assert prefill.prefill_forward.jit_for(None, None, small, None) \
        is prefill.prefill_forward.quick_jitted
    assert prefill.prefill_forward.jit_for(None, None, big, None) is prefill.prefill_forward.jitted
    # rows count: 8 rows of 16 tokens are not small
    assert not prefill.is_small_chunk(None, None, sd((8, 16), jnp.int32), None)
