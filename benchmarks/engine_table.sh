#!/usr/bin/env bash
# Engine vs generate on one GPU in one call: one process per (concurrency, arm) compiles in
# parallel (GPU compiles are slow), then they time one after another behind file barriers, so
# no two processes time at once. Each writes OUTDIR/<name>.json (benchmarks/engine_vs_generate.py).
#   [MODEL=default] [LIMIT=560] [LIMIT_DSPARK=400] [ARMS="plain16 plain60 dspark16 dspark60"]
#   [ENGINE_STEPS=8d,8f,1] bash benchmarks/engine_table.sh OUTDIR
# (a process still compiling at its limit is killed and releases the others' barriers)
set -u
out=${1:?usage: engine_table.sh OUTDIR}
mkdir -p "$out"
bar=$(mktemp -d)
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.2
py=${PYTHON:-python3}
model=${MODEL:-default}
lim=${LIMIT:-560}
lim_dspark=${LIMIT_DSPARK:-400}
names=(plain16 plain60 dspark16 dspark60)
[ "$model" = default ] || names=(plain16 plain60)
[ -n "${ARMS:-}" ] && read -r -a names <<< "$ARMS"
esteps=(); [ -n "${ENGINE_STEPS:-}" ] && esteps=(--engine-steps "$ENGINE_STEPS")
compiled=(); for n in "${names[@]}"; do compiled+=("$bar/c_$n"); done
prev=""
for n in "${names[@]}"; do
  arm=${n%%[0-9]*}; N=${n#$arm}
  waits=("${compiled[@]}"); [ -n "$prev" ] && waits+=("$bar/d_$prev")
  l=$lim; [ "$arm" = dspark ] && l=$lim_dspark
  ( timeout "$l" $py benchmarks/engine_vs_generate.py --model "$model" --concurrency "$N" \
      --arms "$arm" "${esteps[@]}" --compiled-file "$bar/c_$n" --wait-for "${waits[@]}" \
      --done-file "$bar/d_$n" --out "$out/${model}_$n.json" > "$out/${model}_$n.log" 2>&1
    echo "$n exited $?" >> "$out/status.txt"; touch "$bar/c_$n" "$bar/d_$n" ) &
  prev=$n
done
wait
cat "$out/status.txt"
for n in "${names[@]}"; do echo "== $n"; grep -E "^N=|Error|error" "$out/${model}_$n.log" | tail -6; done
