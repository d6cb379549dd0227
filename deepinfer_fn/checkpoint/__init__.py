"""Checkpoint I/O: HF safetensors <-> params (official and transformers names, FP8/FP4;
DeepSeek-V4 and the V4.1 48-shard layout of `layout.inventory`)."""

from deepinfer_fn.checkpoint.safetensors_io import CheckpointError
from deepinfer_fn.checkpoint.loader import load_params, save_params

__all__ = ["CheckpointError", "load_params", "save_params"]
