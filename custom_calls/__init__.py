"""Custom-call kernel implementations, registered into `deepinfer_fn.kernels` on import.

`mosaic_gpu` (Pallas Mosaic GPU, NVIDIA Hopper / sm_90):
  grouped_matmul    custom_calls.grouped_matmul.grouped_matmul_mgpu
  sparse_attention  custom_calls.sparse_attention.sparse_attention_mgpu

Each implementation has `available()` (True only on an sm_90 NVIDIA device, so the
registry's GPU preference falls back to XLA elsewhere) and an `interpret=False` keyword that
runs the kernel under Pallas' GPU interpret mode on CPU (tests/test_kernels_gpu.py).
"""

from deepinfer_fn import kernels as _kernels
from custom_calls.grouped_matmul import grouped_matmul_mgpu
from custom_calls.sparse_attention import sparse_attention_mgpu

_kernels.register("grouped_matmul", "mosaic_gpu")(grouped_matmul_mgpu)
_kernels.register("sparse_attention", "mosaic_gpu")(sparse_attention_mgpu)

__all__ = ["grouped_matmul_mgpu", "sparse_attention_mgpu"]
