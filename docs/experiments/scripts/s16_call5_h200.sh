#!/bin/bash
# For the sixteenth session's fifth device call (H200): the best configuration of s16_call4
# (rounds on the Triton GEMV path, gemv_rows = 64; glue torch.compile'd) with one and four
# iterations per graph (EngineConfig.spec_chain: the host syncs once per program), against
# target-only decoding with and without compile: 16 held-out prompts x 128 new tokens (5
# repeats), then 32 x 32 (7 repeats).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
TREES=docs/experiments/data/2026-12-03-lookahead-tree-probe-h200.json
run_bench() {  # name, timeout, bench args...
  local name=$1 limit=$2; shift 2
  timeout $limit python3 -m rltlab.bench.tree_spec --device cuda --paths engine \
    --trees-from $TREES --budgets 8 --only "chain K=4" "tree B=8" --gemv-rows 64 \
    --chains 1 4 --engine-compile on "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$name rc $?"; grep -vE "^W1203|warn|^ *$" $OUT/$name.log | tail -8 | cut -c1-200
}
run_bench chains_128 240 --repeats 5 --prompts 16 --max-tokens 128
run_bench chains_32 220 --repeats 7
