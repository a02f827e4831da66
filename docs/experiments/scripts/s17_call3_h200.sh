#!/bin/bash
# For the seventeenth session's third device call (H200): s17_call2's benches again, after its
# root-only proposer failed there (private_blocks, fixed in b099a05). The lookup chain (its
# first iteration verifies the lookup drafts too), end to end: root only / chain K = 4 / tree
# B = 8 with lookup chains of 0, 8, 12 and 16, gemv_rows = 64, glue compiled, against
# target-only decoding with and without compile (16 x 128, 5 repeats; 32 x 32, 9 repeats).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
TREES=docs/experiments/data/2026-12-03-lookahead-tree-probe-h200.json
BENCH=(--trees-from $TREES --budgets 8 --only "root only" "chain K=4" "tree B=8"
       --lookup 0 8 12 16 --gemv-rows 64 --chains 1 --engine-compile on)
tree_bench lookup_128 200 "${BENCH[@]}" --repeats 5 --prompts 16 --max-tokens 128
tree_bench lookup_32 170 "${BENCH[@]}" --repeats 9
