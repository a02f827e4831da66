#!/bin/bash
# For the twentieth session's eighth device call (H200): the engine at the session's last code
# (lean rounds, few-row tiles by row tier) on a fresh start, with and without first drafts:
# the paired 32 x 32 bench, chain K = 4 + lookup 10, always and adaptive (15 repeats), then
# 16 x 128 with lookup 16 (5 repeats); spec_pipeline 16, gemv_rows = 64, glue compiled.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
BENCH=(--only "chain K=4" --budgets --gemv-rows 64 --chains 1 --engine-compile on
       --adaptive-lookup --first-drafts)
tree_bench last_32 220 "${BENCH[@]}" --lookup 10 --repeats 15
tree_bench last_128 150 "${BENCH[@]}" --lookup 16 --repeats 5 --prompts 16 --max-tokens 128
