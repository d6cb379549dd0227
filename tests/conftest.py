"""Shared test set-up: CPU only, offline, persistent compilation cache, golden-file access."""

import contextlib
import gc
import os
import pathlib

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Whole programs on disk skip tracing, so a test that patches a traced function would run a
# stored program: off for the suite (tests/test_program_cache.py turns it on where it tests it).
os.environ.setdefault("DEEPINFER_PROGRAM_CACHE", "off")
# 8 fake CPU devices for the sharding tests (tests/test_sharding.py); other tests use device 0.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()
# Compiling, not running, dominates the suite: LLVM's backend optimisations off halves XLA:CPU
# compile time (default model verify forward 11.4 -> 5.0 s, `benchmarks/compile_probe.py`) and the
# tiny test programs run no slower. Set DEEPINFER_TEST_XLA_OPT=1 to keep XLA's default.
if (os.environ.get("DEEPINFER_TEST_XLA_OPT") != "1"
        and "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]):
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"

jax.config.update("jax_compilation_cache_dir", str(ROOT / ".jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def memory_map_count() -> int:
    """Memory regions this process maps (Linux); 0 where /proc is absent."""
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """XLA:CPU maps three memory regions per loaded kernel and keeps every program a jitted
    function compiled: a worker holding the whole suite's programs passes the kernel's
    vm.max_map_count (65,530 by default; 40k maps were seen at 60% of the suite) and dies in
    an mmap. Programs are dropped after each module; later modules reload them from the
    persistent cache."""
    yield
    jax.clear_caches()
    from deepinfer_fn import program_cache
    program_cache.clear_memory()
    gc.collect()
    maps = memory_map_count()
    assert maps < 30_000, (f"{maps} memory maps remain after releasing this module's programs: "
                           "something keeps compiled executables alive (limit 65,530)")


# The slowest default-suite tests (a clean clone on 2 cores, cold compile cache) run with the
# heavy checks, which CI runs too, so the default suite stays near 15 minutes.
HEAVY_IN_CI = {
    "test_sharding.py::test_redundant_experts_on_mesh_equal_single_device[ep=8]",
    "test_sharding.py::test_greedy_generate_on_mesh_equals_single_device[dp=2,ep=4]",
    "test_structured_speculative.py::test_default_model_outputs_are_valid[greedy]",
    "test_structured_speculative.py::test_mixed_batch_free_rows_are_unchanged[dspark]",
    "test_structured_speculative.py::test_dspark_sampled_dynamic_verify_length_is_valid[json]",
    "test_fuzz_engine.py::test_engine_fuzz_request_mix[0-True]",
    "test_engine_cache.py::test_shared_prefix_reuse_is_the_same_in_both_modes[None]",
    "test_engine_speculative.py::test_greedy_equals_plain_generate[dspark]",
    "test_engine_speculative.py::test_greedy_equals_plain_generate[mtp]",
    "test_engine_speculative.py::test_constrained_requests_run_plain_in_a_speculative_engine",
    "test_engine_speculative.py::test_dspark_equals_generate_speculative",
    "test_scan.py::test_forward_chunk_scanned_equals_unrolled[tiny]",
    "test_speculative.py::test_acceptance_on_default_model",
    "test_speculative.py::test_stream_generate_mtp_pieces",
    "test_cli.py::test_forward_and_precompile_help",
    "test_cli.py::test_generate_raw_sampled_quiet_prints_only_the_text",
    "test_engine.py::test_engine_bounded_replay_follows_the_recipe",
    "test_batch.py::test_round_trip_content_usage_and_finish_match_the_engine",
    "test_generate.py::test_greedy_generate_equals_forward_argmax_rollout",
    "test_fuzz_engine.py::test_engine_fuzz_request_mix[2-False]",
    "test_batch.py::test_stop_sequence_ends_the_response_and_the_engine_request",
    "test_fuzz_api.py::test_generate_valid_and_mixed_fuzz",
    "test_engine_structured.py::test_engine_constrained_matches_generate_and_is_valid[True]",
    "test_compile.py::test_generate_compiles_few_programs_and_reuses_them",
}


def pytest_collection_modifyitems(config, items):
    known = set()
    for item in items:
        key = f"{item.path.name}::{item.name}"
        if key in HEAVY_IN_CI:
            item.add_marker(pytest.mark.heavy)
            known.add(key)
    whole_run = not config.args or all(a.rstrip("/").endswith("tests") for a in config.args)
    if whole_run and not config.getoption("keyword") and known != HEAVY_IN_CI:
        raise pytest.UsageError(f"HEAVY_IN_CI names tests that do not exist: "
                                f"{sorted(HEAVY_IN_CI - known)}")


@contextlib.contextmanager
def no_cache_writes():
    """Compiles inside are not written to the persistent cache (reads still hit). For the
    sharded speculative programs: one local run aborted inside JAX's cache write
    (executable.serialize) of the sharded DSpark loop, and no such program is reused."""
    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
    try:
        yield
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


class Golden:
    """A transformers reference folder: its checkpoint dir and captured tensors."""

    def __init__(self, name: str):
        from deepinfer_fn.checkpoint.safetensors_io import SafetensorsFile
        self.name = name
        self.path = GOLDEN / name
        self._ref = SafetensorsFile(self.path / "reference.safetensors")

    def __contains__(self, key):
        return key in self._ref.keys()

    def __getitem__(self, key) -> np.ndarray:
        return np.array(self._ref.get(key))


_PARAMS = {}


def golden_params(name: str):
    """Params loaded (once per session) from a golden checkpoint."""
    import deepinfer_fn as di
    if name not in _PARAMS:
        _PARAMS[name] = di.load_params(GOLDEN / name)
    return _PARAMS[name]


@pytest.fixture(scope="session")
def golden():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = Golden(name)
        return cache[name]
    return get


def rel_err(got, want) -> float:
    """max |got - want| / max |want|: the parity figure used throughout the tests."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
