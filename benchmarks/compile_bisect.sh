#!/usr/bin/env bash
# Bisects the GPU compile stall: compile_stages.py variants run at once, each stopped by
# timeout; logs in DIR (default /tmp/bisect), packed into $OUT when OUT is set.
#   bash benchmarks/compile_bisect.sh DIR [SECONDS] [SET]
# SET "stall" (default): which part and pass stall; "sinkhorn": Sinkhorn forms and the Mosaic
# mHC kernels, each as one mHC alone and as the default model's decode step.
set -u
dir=${1:-/tmp/bisect}; limit=${2:-150}; set=${3:-stall}
mkdir -p "$dir"
export PYTHONPATH=. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DEEPINFER_COMPILE_CACHE=0
export XLA_PYTHON_CLIENT_PREALLOCATE=false DUMP_AFTER=$((limit - 4))
run() {  # name, env assignments...
  local name=$1; shift
  ( env "$@" timeout "$limit" python benchmarks/compile_stages.py > "$dir/$name.log" 2>&1
    echo "rc=$?" >> "$dir/$name.log" ) &
}
if [ "$set" = passes ]; then  # where the remaining compile time goes, few runs at a time
  stats="--xla_gpu_print_compilation_stats"
  run default_passes TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=hlo_pass_pipeline=1 XLA_FLAGS=$stats
  run tiny PRESET=tiny
  run mini PRESET=mini
  wait
  for v in chunk5 chunk10; do run "mhc_$v" PART=mhc SINKHORN=$v; done
  run mhc PART=mhc
  run default_chunk5 SINKHORN=chunk5
  wait
  for f in "$dir"/*.log; do echo "== $f"; grep -E '^\[.*(lowered|compiled|ran)|rc=|Error' "$f" | tail -4; done
  [ -n "${OUT:-}" ] && tar -czf "$OUT/passes_logs.tar.gz" -C "$dir" .
  exit 0
fi
if [ "$set" = sinkhorn ]; then
  mosaic=mhc_pre=mosaic_gpu,mhc_post=mosaic_gpu
  for v in barrier scalar scalar_barrier loop; do
    run "mhc_$v" PART=mhc SINKHORN=$v
    run "default_$v" SINKHORN=$v
  done
  run mhc_mosaic PART=mhc DEEPINFER_KERNELS=$mosaic
  run default_mosaic DEEPINFER_KERNELS=$mosaic
  run default_mosaic_all DEEPINFER_KERNELS=$mosaic,attention=mosaic_gpu,compressor_decode=mosaic_gpu
  run default_scalar_barrier_attn SINKHORN=scalar_barrier DEEPINFER_KERNELS=attention=mosaic_gpu,compressor_decode=mosaic_gpu
  wait
  for f in "$dir"/*.log; do echo "== $f"; grep -E '^\[.*(compiled|ran)|rc=|Error' "$f" | tail -4; done
  [ -n "${OUT:-}" ] && tar -czf "$OUT/sinkhorn_logs.tar.gz" -C "$dir" .
  exit 0
fi
run base_fusionlog TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=priority_fusion=4,hlo_pass_pipeline=1
run no_triton_softmax XLA_FLAGS="--xla_gpu_experimental_enable_triton_softmax_priority_fusion=false --xla_gpu_enable_triton_softmax_priority_fusion=false"
run no_priority_fusion XLA_FLAGS=--xla_disable_hlo_passes=priority-fusion
run triton_level0 XLA_FLAGS=--xla_gpu_triton_fusion_level=0
run mhc20 PART=mhc ITERS=20
run mhc1 PART=mhc ITERS=1
run swa_moe LAYERS=sliding_attention:moe
run csa_moe LAYERS=compressed_sparse_attention:moe
run hca_moe LAYERS=heavily_compressed_attention:moe
run swa_hash LAYERS=sliding_attention:hash_moe
run tiny_stats PRESET=tiny TF_CPP_MIN_LOG_LEVEL=0 XLA_FLAGS="--xla_gpu_print_compilation_stats --xla_dump_to=$dir/tiny_dump"
wait
for f in "$dir"/*.log; do echo "== $f"; grep -v '^\s*$' "$f" | grep -E '^\[|rc=|Error|error' | tail -6; done
if [ -n "${OUT:-}" ]; then
  head -c 300000000 "$dir/base_fusionlog.log" | gzip -6 > "$OUT/fusionlog.gz"
  tar -czf "$OUT/tiny_dump.tar.gz" -C "$dir" --wildcards 'tiny_dump/*after_optimizations.txt' 'tiny_dump/*before_optimizations.txt'
  tar -czf "$OUT/bisect_logs.tar.gz" -C "$dir" --exclude=tiny_dump --exclude=base_fusionlog.log .
  ls -la "$OUT"
fi
