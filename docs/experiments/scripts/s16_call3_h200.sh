#!/bin/bash
# For the sixteenth session's third device call (H200): with the swept FMA tiles in
# kernels/small_batch.TILES, where a tree iteration's GPU time goes (rounds vs glue,
# tree_iteration_split.py) with gemv_rows 1 and 64, then end to end, paired against the same
# engine's target-only decoding: 32 held-out prompts x 32 new tokens, and 16 x 128.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
TREES=docs/experiments/data/2026-12-03-lookahead-tree-probe-h200.json
timeout 150 python3 docs/experiments/scripts/tree_iteration_split.py --trees-from $TREES \
  --budgets 8 > $OUT/tree_iteration_split.log 2>&1
echo "split rc $?"; grep -E "^\{\"tree" $OUT/tree_iteration_split.log | cut -c1-330
run_bench() {  # name, timeout, bench args...
  local name=$1 limit=$2; shift 2
  timeout $limit python3 -m rltlab.bench.tree_spec --device cuda --paths engine \
    --trees-from $TREES --budgets 8 --gemv-rows 1 64 --chains 1 "$@" --out $OUT/$name.json \
    > $OUT/$name.log 2>&1
  echo "$name rc $?"; grep -vE "^W1203|warn|^ *$" $OUT/$name.log | tail -11 | cut -c1-200
}
run_bench gemv_32 240 --repeats 7
run_bench gemv_128 200 --repeats 3 --prompts 16 --max-tokens 128
