"""benchmarks/compile_deviceless.py without its CUDA plugin: a clear error, not a traceback."""

import importlib.util

import pytest

from benchmarks import compile_deviceless as cd


def _has_cuda_plugin() -> bool:
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda13") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(_has_cuda_plugin(), reason="the CUDA plugin is installed here")
def test_missing_plugin_names_the_set_up():
    with pytest.raises(SystemExit, match="CUDA PJRT plugin is not importable"):
        cd.gpu_sharding(open(cd.TARGET).read())


def test_fusion_count_of_a_module_text():
    text = ("ENTRY %main {\n  %a = f32[4]{0} fusion(f32[4]{0} %p), kind=kLoop\n"
            "  %b = (f32[4]{0}, f32[]) fusion(%a), kind=kInput\n  ROOT %c = f32[4] copy(%a)\n}")
    assert cd.fusions(text) == 2
