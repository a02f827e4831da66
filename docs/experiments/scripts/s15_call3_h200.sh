#!/bin/bash
# For the fifteenth session's third device call (H200): the engine's tree iterations with their
# rows through the Triton small-M GEMV (TreeProposer(gemv=True): chain K = 4 is 5 rows, the
# B = 8 tree 16) beside the cuBLAS rows of s15_call1/2, paired against target-only; then
# the GPU time of one iteration for both. It ran at commit 9cdb428; the gemv option was
# removed afterwards (2.2x slower per iteration: docs/experiments/loop_speculation.md).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
TREES=docs/experiments/data/2026-12-03-lookahead-tree-probe-h200.json
run_bench() {  # name, bench args...
  local name=$1; shift
  timeout 250 python3 -m rltlab.bench.tree_spec --device cuda --paths engine --gemv \
    --trees-from $TREES --budgets 8 "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$name rc $?"; grep -vE "^W1203|warn|^ *$" $OUT/$name.log | tail -16 | cut -c1-200
}
run_bench gemv_32 --repeats 7 --chains 1 4
run_bench gemv_128 --repeats 3 --prompts 16 --max-tokens 128 --chains 1 4
timeout 100 python3 docs/experiments/scripts/tree_graph_timing.py --trees-from $TREES \
  --budgets 8 --gemv --device cuda > $OUT/tree_graph_timing.log 2>&1
echo "timing rc $?"; grep -vE "^W1203|warn|^ *$" $OUT/tree_graph_timing.log | tail -12 | cut -c1-200
