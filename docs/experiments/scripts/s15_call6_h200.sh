#!/bin/bash
# For the fifteenth session's sixth device call (H200): s15_call4's commands again, now that
# EngineConfig.compile also torch.compile's the tree program's glue around the rounds (the
# indices, block copies, acceptance walk, commit and heads: tree_graph._Program._prepare /
# _conclude).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
TREES=docs/experiments/data/2026-12-03-lookahead-tree-probe-h200.json
run_bench() {  # name, timeout, bench args...
  local name=$1 limit=$2; shift 2
  timeout $limit python3 -m rltlab.bench.tree_spec --device cuda --paths engine \
    --engine-compile off on --trees-from $TREES --budgets 8 "$@" --out $OUT/$name.json \
    > $OUT/$name.log 2>&1
  echo "$name rc $?"; grep -vE "^W1203|warn|^ *$" $OUT/$name.log | tail -13 | cut -c1-200
}
run_bench compile_32 300 --repeats 7 --chains 1
run_bench compile_128 200 --repeats 3 --prompts 16 --max-tokens 128 --chains 1
