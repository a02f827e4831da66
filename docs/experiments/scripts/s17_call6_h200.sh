#!/bin/bash
# For the seventeenth session's sixth device call (H200): chain K = 4 with a lookup chain (16 on
# 16 x 128, 8 on 32 x 32: each workload's best in call 4) at spec_chain 1, 2 and 4 (iterations
# per graph, one read-back each), gemv_rows = 64, glue compiled, against target-only decoding:
# 16 x 128 (7 repeats), 32 x 32 (9 repeats).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
BENCH=(--budgets --only "chain K=4" --gemv-rows 64 --chains 1 2 4 --engine-compile on)
tree_bench chains_128 110 "${BENCH[@]}" --lookup 16 --repeats 7 --prompts 16 --max-tokens 128
tree_bench chains_32 100 "${BENCH[@]}" --lookup 8 --repeats 9
