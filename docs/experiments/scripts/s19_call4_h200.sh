#!/bin/bash
# For the nineteenth session's fourth device call (H200): TreeProposer(adaptive_lookup=True),
# where an iteration runs the lookup chain's rows only after a lookup hit (a CPU replay of the
# rule on 32 x 32 gave tau 2.94 against 3.07, with 91 of 245 iterations on all 16 rows and the
# rest on the heads' 5). The paired 32 x 32 bench with lookup 8 / 10, each always and adaptive
# (11 repeats), then 16 x 128 with lookup 16 both ways (5 repeats); spec_pipeline 16 (the
# default), gemv_rows = 64, glue compiled.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
BENCH=(--only "chain K=4" --budgets --gemv-rows 64 --chains 1 --engine-compile on
       --adaptive-lookup)
tree_bench adaptive_32 200 "${BENCH[@]}" --lookup 8 10 --repeats 11
tree_bench adaptive_128 150 "${BENCH[@]}" --lookup 16 --repeats 5 --prompts 16 --max-tokens 128
