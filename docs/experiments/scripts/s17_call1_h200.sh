#!/bin/bash
# For the seventeenth session's first device call (H200): a prompt-lookup chain beside the
# lookahead heads' tree (TreeProposer(lookup=L), rltlab.engine.prompt_lookup), in the best
# configuration of s16 (gemv_rows = 64, glue compiled, spec_chain 1): root only, chain K = 4 and
# tree B = 8, each without and with lookup chains of 8 and 16, against target-only decoding
# with and without compile: 16 held-out prompts x 128 new tokens (5 repeats), then 32 x 32 (7).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
TREES=docs/experiments/data/2026-12-03-lookahead-tree-probe-h200.json
run_bench() {  # name, timeout, bench args...
  local name=$1 limit=$2; shift 2
  timeout $limit python3 -m rltlab.bench.tree_spec --device cuda --paths engine \
    --trees-from $TREES --budgets 8 --only "root only" "chain K=4" "tree B=8" \
    --lookup 0 8 16 --gemv-rows 64 --chains 1 --engine-compile on "$@" \
    --out $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$name rc $?"; grep -vE "^W1204|warn|^ *$" $OUT/$name.log | tail -14 | cut -c1-200
}
run_bench lookup_128 280 --repeats 5 --prompts 16 --max-tokens 128
run_bench lookup_32 260 --repeats 7
