#!/bin/bash
# For the nineteenth session's sixth device call (H200): the session's HEAD (the program moved
# to rltlab/engine/tree_program.py, behaviour unchanged) on a fresh machine start. The paired
# 32 x 32 bench with chain K = 4 alone, + lookup 10 and + lookup 10 adaptive (15 repeats), then
# 16 x 128 with lookup 16 both ways (5 repeats); spec_pipeline 16 (the default), gemv_rows =
# 64, glue compiled.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
BENCH=(--only "chain K=4" --budgets --gemv-rows 64 --chains 1 --engine-compile on
       --adaptive-lookup)
tree_bench head_32 200 "${BENCH[@]}" --lookup 0 10 --repeats 15
tree_bench head_128 150 "${BENCH[@]}" --lookup 16 --repeats 5 --prompts 16 --max-tokens 128
