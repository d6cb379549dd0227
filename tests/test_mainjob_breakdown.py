"""benchmarks/mainjob_breakdown.py: each arm's environment (the run itself is a GPU benchmark)."""

import shutil

import pytest

from benchmarks import mainjob_breakdown as mb


def test_arms_set_the_cache_and_quick_compile_environment(monkeypatch):
    monkeypatch.setenv("DEEPINFER_QUICK_COMPILE", "off")        # the caller's value is dropped
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/elsewhere")
    monkeypatch.setenv("DEEPINFER_LOOP_PREFILL", "off")
    dirs = {}
    cold, warm = mb.arm_env("cold", dirs), mb.arm_env("warm", dirs)
    assert cold["DEEPINFER_COMPILE_CACHE"] == warm["DEEPINFER_COMPILE_CACHE"] == dirs["cold"]
    assert "DEEPINFER_QUICK_COMPILE" not in cold and "JAX_COMPILATION_CACHE_DIR" not in cold
    other = mb.arm_env("cold_no_quick", dirs)
    assert other["DEEPINFER_COMPILE_CACHE"] not in (dirs["cold"], "off")
    assert other["DEEPINFER_QUICK_COMPILE"] == "off"
    off = mb.arm_env("no_cache_no_quick", dirs)
    assert off["DEEPINFER_COMPILE_CACHE"] == "off" and off["DEEPINFER_QUICK_COMPILE"] == "off"
    assert "DEEPINFER_LOOP_PREFILL" not in off
    chunked = mb.arm_env("cold_chunked", dirs)
    assert chunked["DEEPINFER_LOOP_PREFILL"] == "off"
    assert chunked["DEEPINFER_COMPILE_CACHE"] not in (dirs["cold"], other["DEEPINFER_COMPILE_CACHE"])
    assert mb.arm_env("no_cache_chunked", dirs)["DEEPINFER_LOOP_PREFILL"] == "off"
    for d in dirs.values():
        shutil.rmtree(d)


def test_bad_arms_are_rejected_before_anything_runs(capsys):
    with pytest.raises(SystemExit):
        mb.main(["--arms", "cold,lukewarm"])
    assert "lukewarm" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mb.main(["--arms", "warm"])
    assert "list cold before warm" in capsys.readouterr().err
