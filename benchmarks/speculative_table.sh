#!/usr/bin/env bash
# The speculative-decoding table on one GPU in one call: four processes compile in parallel
# (GPU compile is slow: ~40-60 s per program), then time one after another (file barriers), so
# no two processes time at once. Each writes its own JSON; benchmarks/speculative_merge.py joins them.
#   [PLAIN=0] [REMEASURE="60:6 ..."] [LIMIT=560] bash benchmarks/speculative_table.sh OUTDIR [COST_FILE]
set -u
out=${1:?usage: speculative_table.sh OUTDIR [COST_FILE]}
cost=${2:-benchmarks/results/verify_cost_h200.json}
mkdir -p "$out"
bar=$(mktemp -d)            # barrier files (kept out of OUTDIR)
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.2
py=${PYTHON:-python3}
common=(--cost-file "$cost" --calibrate off)
lim=${LIMIT:-560}
# run NAME FILES_TO_TOUCH_ON_EXIT -- ARGS: a failed process still releases the others' barriers
run() {
  local name=$1 release=$2; shift 2
  timeout "$lim" $py benchmarks/speculative.py "${common[@]}" "$@" --out "$out/$name.json" \
      > "$out/$name.log" 2>&1
  echo "$name exited $?" >> "$out/status.txt"
  for f in $release; do touch "$bar/$f"; done
}
plain=${PLAIN:-1}          # PLAIN=0: no plain-decoding peer (two processes, less compiling)
waits=("$bar/c60"); [ "$plain" = 1 ] && waits+=("$bar/c16p" "$bar/c60p")
remeasure=(); [ -n "${REMEASURE:-}" ] && remeasure=(--remeasure $REMEASURE)
run spec16 "d1" --concurrency 16 --arms fixed dynamic \
    --wait-for "${waits[@]}" --done-file "$bar/d1" &
run spec60 "c60 d2" "${remeasure[@]}" --concurrency 60 --arms fixed dynamic \
    --compiled-file "$bar/c60" --wait-for "$bar/d1" --done-file "$bar/d2" &
[ "$plain" = 1 ] && run plain16 "c16p d3" --concurrency 16 --arms plain \
    --compiled-file "$bar/c16p" --wait-for "$bar/d2" --done-file "$bar/d3" &
[ "$plain" = 1 ] && run plain60 "c60p" --concurrency 60 --arms plain --compiled-file "$bar/c60p" --wait-for "$bar/d3" &
wait
cat "$out/status.txt"
for f in spec16 spec60 plain16 plain60; do [ -f "$out/$f.log" ] || continue; echo "== $f"; grep -v "^  verify\|^  B=" "$out/$f.log" | tail -8; done
