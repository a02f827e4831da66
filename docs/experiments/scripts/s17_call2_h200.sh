#!/bin/bash
# For the seventeenth session's second device call (H200), at the committed lookup chain (its
# first iteration verifies the lookup drafts too): end to end, root only / chain K = 4 / tree
# B = 8 with lookup chains of 0, 8, 12 and 16, gemv_rows = 64, glue compiled, against
# target-only decoding with and without compile (16 x 128, 5 repeats; 32 x 32, 9 repeats); the
# wall-time profile of chain K = 4 with and without lookup 16 (16 x 128); one iteration's GPU
# time split into rounds and glue with lookup 8 and 16.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
TREES=docs/experiments/data/2026-12-03-lookahead-tree-probe-h200.json
BENCH=(--trees-from $TREES --budgets 8 --only "root only" "chain K=4" "tree B=8"
       --lookup 0 8 12 16 --gemv-rows 64 --chains 1 --engine-compile on)
tree_bench lookup_128 200 "${BENCH[@]}" --repeats 5 --prompts 16 --max-tokens 128
tree_bench lookup_32 170 "${BENCH[@]}" --repeats 9
timeout 90 python3 docs/experiments/scripts/tree_engine_profile.py --device cuda --gemv-rows 64 \
  --compile --only "chain K=4" --lookup 0 16 --prompts 16 --max-tokens 128 \
  > $OUT/profile_128.log 2>&1
echo "profile rc $?"; tail -1 $OUT/profile_128.log | cut -c1-1500
for n in 8 16; do
  timeout 60 python3 docs/experiments/scripts/tree_iteration_split.py --only "chain K=4" \
    --gemv-rows 64 --compile on --lookup $n > /tmp/split_$n.log 2>&1
  echo "split lookup $n rc $?"; tail -1 /tmp/split_$n.log | cut -c1-600
  cat /tmp/split_$n.log >> $OUT/split.log
done
