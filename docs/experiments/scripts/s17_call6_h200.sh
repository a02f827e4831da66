#!/bin/bash
# For the seventeenth session's sixth device call (H200): chain K = 4 with a lookup chain (16 on
# 16 x 128, 8 on 32 x 32: each workload's best in call 4) at spec_chain 1, 2 and 4 (iterations
# per graph, one read-back each), gemv_rows = 64, glue compiled, against target-only decoding:
# 16 x 128 (7 repeats), 32 x 32 (9 repeats).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
run_bench() {  # name, timeout, bench args...
  local name=$1 limit=$2; shift 2
  timeout $limit python3 -m rltlab.bench.tree_spec --device cuda --paths engine \
    --budgets --only "chain K=4" --gemv-rows 64 --chains 1 2 4 \
    --engine-compile on "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$name rc $?"; grep -vE "^W1204|warn|^ *$" $OUT/$name.log | tail -10 | cut -c1-200
}
run_bench chains_128 110 --lookup 16 --repeats 7 --prompts 16 --max-tokens 128
run_bench chains_32 100 --lookup 8 --repeats 9
