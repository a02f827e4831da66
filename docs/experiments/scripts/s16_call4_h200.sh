#!/bin/bash
# For the sixteenth session's fourth device call (H200): s16_call3 found a tree iteration's glue
# (indices, prefix-block copies, LM head, walk, commit, heads: ~118 small kernels) at 0.19-0.30
# ms of 0.58-1.10. Here the glue torch.compile'd (EngineConfig.compile) while the rounds stay on
# the Triton GEMV path (gemv_rows = 64): its split (tree_iteration_split.py), then end to end
# against target-only decoding with and without compile, 32 x 32 and 16 x 128.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
TREES=docs/experiments/data/2026-12-03-lookahead-tree-probe-h200.json
ONLY=("chain K=4" "tree B=8")
timeout 200 python3 docs/experiments/scripts/tree_iteration_split.py --trees-from $TREES \
  --budgets 8 --only "${ONLY[@]}" --gemv-rows 64 --compile on \
  > $OUT/tree_iteration_split.log 2>&1
echo "split rc $?"; grep -E "^\{\"tree" $OUT/tree_iteration_split.log | cut -c1-330
run_bench() {  # name, timeout, bench args...
  local name=$1 limit=$2; shift 2
  timeout $limit python3 -m rltlab.bench.tree_spec --device cuda --paths engine \
    --trees-from $TREES --budgets 8 --only "${ONLY[@]}" --gemv-rows 64 --chains 1 \
    --engine-compile off on "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$name rc $?"; grep -vE "^W1203|warn|^ *$" $OUT/$name.log | tail -8 | cut -c1-200
}
run_bench compile_32 250 --repeats 7
run_bench compile_128 200 --repeats 3 --prompts 16 --max-tokens 128
