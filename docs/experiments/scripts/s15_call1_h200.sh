#!/bin/bash
# For the fifteenth session's first device call (H200): tree speculative decoding inside the
# paged engine (rltlab.engine.tree_graph: the tree's rows through the engine's static decoder,
# one CUDA graph for spec_chain iterations), paired against the same engine's target-only
# decoding. First the s14 workload (32 held-out prompts, 32 new tokens) for every tree and
# chain length, then 128 new tokens for the chains that matter; last, the GPU time of one
# iteration (tree_graph_timing.py).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
TREES=docs/experiments/data/2026-12-03-lookahead-tree-probe-h200.json
run_bench() {  # name, bench args...
  local name=$1; shift
  timeout 280 python3 -m rltlab.bench.tree_spec --device cuda --paths engine \
    --trees-from $TREES "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$name rc $?"; grep -vE "^W1203|warn|^ *$" $OUT/$name.log | tail -22 | cut -c1-200
}
run_bench tree_engine_32 --repeats 5 --budgets 8 32 64 --chains 1 4 8
run_bench tree_engine_128 --repeats 3 --prompts 16 --max-tokens 128 --budgets 8 32 \
  --chains 4 8
timeout 120 python3 docs/experiments/scripts/tree_graph_timing.py --trees-from $TREES \
  --budgets 8 32 64 --device cuda > $OUT/tree_graph_timing.log 2>&1
echo "timing rc $?"; grep -vE "^W1203|warn|^ *$" $OUT/tree_graph_timing.log | tail -16 | cut -c1-200
