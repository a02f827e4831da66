#!/bin/bash
# For the nineteenth session's eighth device call (H200): TreeProposer(first_drafts=True), a
# request's first iteration drafted inside its program from the state that sampled token 0
# (the eighteenth session's host-side version ran 0.96x). The paired 32 x 32 bench with chain
# K = 4 + lookup 10, always and adaptive, each with and without first drafts (15 repeats),
# then 16 x 128 with lookup 16 (5 repeats); spec_pipeline 16, gemv_rows = 64, glue compiled.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
BENCH=(--only "chain K=4" --budgets --gemv-rows 64 --chains 1 --engine-compile on
       --adaptive-lookup --first-drafts)
tree_bench first_32 220 "${BENCH[@]}" --lookup 10 --repeats 15
tree_bench first_128 150 "${BENCH[@]}" --lookup 16 --repeats 5 --prompts 16 --max-tokens 128
