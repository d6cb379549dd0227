"""Custom-call kernel implementations, registered into `deepinfer_fn.kernel_registry` on import
(`deepinfer_fn.kernels` imports this package).

`mosaic_gpu` (Pallas Mosaic GPU, NVIDIA Hopper / sm_90):
  grouped_matmul    custom_calls.grouped_matmul.grouped_matmul_mgpu
  grouped_swiglu    custom_calls.grouped_matmul.grouped_swiglu_mgpu
  sparse_attention  custom_calls.sparse_attention.sparse_attention_mgpu
  mhc_pre/mhc_post  custom_calls.mhc.mhc_pre_mgpu / mhc_post_mgpu
  sinkhorn          custom_calls.mhc.sinkhorn_mgpu
  attention         custom_calls.attention.attention_mgpu
  chunk_attention   custom_calls.chunk_attention.chunk_attention_mgpu  (prefill chunks)
  index_scores      custom_calls.indexer.index_scores_mgpu  (prefill chunks)
  compressor_decode custom_calls.compressor.compressor_decode_mgpu  (opt-in: available() is False)
  linear            custom_calls.dense.linear_mgpu          (decode rows: M <= 64)
  grouped_linear    custom_calls.dense.grouped_linear_mgpu  (decode rows: M <= 64)
  linear_many       custom_calls.dense.linear_many_mgpu     (decode rows: M <= 64)

Each implementation has `available()` (True only on an sm_90 NVIDIA device, so the
registry's GPU preference falls back to XLA elsewhere) and an `interpret=False` keyword that
runs the kernel under Pallas' GPU interpret mode on CPU (tests/test_kernels_gpu.py). Inputs a
kernel does not support fall back to the XLA reference (`deepinfer_fn.kernels_xla`).
"""

from deepinfer_fn.kernel_registry import register
from custom_calls.grouped_matmul import grouped_matmul_mgpu, grouped_swiglu_mgpu
from custom_calls.sparse_attention import sparse_attention_mgpu
from custom_calls.mhc import (mhc_post_mgpu, mhc_pre_mgpu, mhc_pre_prefers, mhc_prefers,
                              sinkhorn_mgpu)
from custom_calls.attention import attention_mgpu
from custom_calls.chunk_attention import chunk_attention_mgpu
from custom_calls.indexer import index_scores_mgpu
from custom_calls.compressor import compressor_decode_mgpu
from custom_calls.dense import grouped_linear_mgpu, linear_many_mgpu, linear_mgpu

register("grouped_matmul", "mosaic_gpu")(grouped_matmul_mgpu)
register("grouped_swiglu", "mosaic_gpu")(grouped_swiglu_mgpu)
register("sparse_attention", "mosaic_gpu")(sparse_attention_mgpu)
register("mhc_pre", "mosaic_gpu")(mhc_pre_mgpu)
register("mhc_post", "mosaic_gpu")(mhc_post_mgpu)
register("sinkhorn", "mosaic_gpu")(sinkhorn_mgpu)
register("attention", "mosaic_gpu")(attention_mgpu)
register("chunk_attention", "mosaic_gpu")(chunk_attention_mgpu)
register("index_scores", "mosaic_gpu")(index_scores_mgpu)
register("compressor_decode", "mosaic_gpu")(compressor_decode_mgpu)
register("linear", "mosaic_gpu")(linear_mgpu)
register("grouped_linear", "mosaic_gpu")(grouped_linear_mgpu)
register("linear_many", "mosaic_gpu")(linear_many_mgpu)

# Opt-in: never chosen by platform preference, only when forced (deepinfer_fn/kernels.py).
# grouped_swiglu: tested (interpret mode, lowering) but not yet timed on a GPU.
for _fn in (attention_mgpu, compressor_decode_mgpu, grouped_swiglu_mgpu):
    _fn.opt_in = True
# The mHC post kernel: chosen on narrow streams of 128 tokens or more only; the pre side
# picks its own path.
mhc_post_mgpu.prefers = mhc_prefers
mhc_pre_mgpu.prefers = mhc_pre_prefers

__all__ = ["grouped_matmul_mgpu", "grouped_swiglu_mgpu", "sparse_attention_mgpu", "mhc_pre_mgpu", "mhc_post_mgpu",
           "sinkhorn_mgpu",
           "attention_mgpu", "chunk_attention_mgpu", "index_scores_mgpu", "compressor_decode_mgpu", "linear_mgpu", "grouped_linear_mgpu",
           "linear_many_mgpu"]
