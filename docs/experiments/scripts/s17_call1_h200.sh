#!/bin/bash
# For the seventeenth session's first device call (H200): a prompt-lookup chain beside the
# lookahead heads' tree (TreeProposer(lookup=L), rltlab.engine.prompt_lookup), in the best
# configuration of s16 (gemv_rows = 64, glue compiled, spec_chain 1): root only, chain K = 4 and
# tree B = 8, each without and with lookup chains of 8 and 16, against target-only decoding
# with and without compile: 16 held-out prompts x 128 new tokens (5 repeats), then 32 x 32 (7).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
TREES=docs/experiments/data/2026-12-03-lookahead-tree-probe-h200.json
BENCH=(--trees-from $TREES --budgets 8 --only "root only" "chain K=4" "tree B=8"
       --lookup 0 8 16 --gemv-rows 64 --chains 1 --engine-compile on)
tree_bench lookup_128 280 "${BENCH[@]}" --repeats 5 --prompts 16 --max-tokens 128
tree_bench lookup_32 260 "${BENCH[@]}" --repeats 7
