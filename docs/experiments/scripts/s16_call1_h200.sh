#!/bin/bash
# For the sixteenth session's first device call (H200): trees and chains of 2..64 rows through
# the Triton GEMV path (EngineConfig.gemv_rows = 64: fp32 rows as FMA products on each loaded
# weight tile, RoPE + K/V write in the q/k/v GEMV, PDL, L2 prefetch) against the same trees
# through cuBLAS (gemv_rows = 1), all paired against the same engine's target-only decoding.
# First the kernels' own tests on the GPU, then the GPU time per iteration, then end to end:
# 32 held-out prompts x 32 new tokens, and 16 x 128.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
TREES=docs/experiments/data/2026-12-03-lookahead-tree-probe-h200.json
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_small_batch.py \
  tests/test_kernels_rope_gemv.py > $OUT/kernel_tests.log 2>&1
echo "kernel tests rc $?: $(tail -1 $OUT/kernel_tests.log)"
timeout 150 python3 docs/experiments/scripts/tree_graph_timing.py --trees-from $TREES \
  --budgets 8 24 --chains 1 --gemv-rows 1 64 --device cuda > $OUT/tree_graph_timing.log 2>&1
echo "timing rc $?"; grep -vE "^W1203|warn|^ *$" $OUT/tree_graph_timing.log | tail -12 | cut -c1-220
run_bench() {  # name, timeout, bench args...
  local name=$1 limit=$2; shift 2
  timeout $limit python3 -m rltlab.bench.tree_spec --device cuda --paths engine \
    --trees-from $TREES --budgets 8 --gemv-rows 1 64 --chains 1 "$@" --out $OUT/$name.json \
    > $OUT/$name.log 2>&1
  echo "$name rc $?"; grep -vE "^W1203|warn|^ *$" $OUT/$name.log | tail -12 | cut -c1-200
}
run_bench gemv_32 240 --repeats 7
run_bench gemv_128 200 --repeats 3 --prompts 16 --max-tokens 128
