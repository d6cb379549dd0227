"""deepinfer_fn: a functional JAX/XLA inference engine for the DeepSeek-V4 family."""

from deepinfer_fn.compile_cache import ProgramCounter, enable_persistent_cache, precompile

enable_persistent_cache()  # per-user directory; DEEPINFER_COMPILE_CACHE moves or disables it

from deepinfer_fn.errors import ArgumentError, ArgumentTypeError
from deepinfer_fn.config import ConfigError, ModelConfig
from deepinfer_fn.params import Params, count_params, init_params, param_specs
from deepinfer_fn.api import forward, mtp_forward
from deepinfer_fn.checkpoint import CheckpointError, load_params, save_params
from deepinfer_fn.generate import GenerateOutput, generate, stream_generate
from deepinfer_fn.state import DecodeState, init_state
from deepinfer_fn.default_model import default_model_path
from deepinfer_fn.bundle import Model, load_model
from deepinfer_fn.structured import Grammar, JsonSchema, Regex
from deepinfer_fn.engine import Engine, Request, RequestOutput

__all__ = [
    "ConfigError", "ModelConfig", "Params", "count_params", "init_params", "param_specs",
    "forward", "mtp_forward", "CheckpointError", "load_params", "save_params",
    "GenerateOutput", "generate", "stream_generate", "default_model_path", "DecodeState", "init_state",
    "Model", "load_model", "Regex", "JsonSchema", "Grammar", "Engine", "Request", "RequestOutput",
    "ProgramCounter", "enable_persistent_cache", "precompile", "ArgumentError", "ArgumentTypeError",
]

__all__ += ["make_mesh", "shard_params", "abstract_params"]


def __getattr__(name):
    # `shardings` imports deepinfer_fn's modules, so its API is attached lazily (no cycle).
    if name in ("make_mesh", "shard_params", "abstract_params"):
        import shardings.mesh
        return getattr(shardings.mesh, name)
    raise AttributeError(f"module 'deepinfer_fn' has no attribute {name!r}")
