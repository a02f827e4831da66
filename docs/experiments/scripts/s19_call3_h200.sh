#!/bin/bash
# For the nineteenth session's third device call (H200): the step from one tree iteration to
# the next (its successor's inputs, the lookup history) compiled with the rest of the glue, and
# a chain's drafts by argmax instead of topk. Where 32 x 32's time goes now (host timers), then
# the paired 32 x 32 bench with lookup chains of 8 / 10 / 12 (14 / 16 / 18 rows: 16 rows fill
# the FMA GEMVs' row block) at the default spec_pipeline 16 (9 repeats), and 16 x 128 with
# lookup 16 (5 repeats); gemv_rows = 64, glue compiled.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
PROFILE_CUT=3000 tree_profile 32 32 120 --gemv-rows 64 --compile --only "chain K=4" --lookup 8
BENCH=(--only "chain K=4" --budgets --gemv-rows 64 --chains 1 --engine-compile on)
tree_bench glue_32 170 "${BENCH[@]}" --lookup 8 10 12 --repeats 9
tree_bench glue_128 150 "${BENCH[@]}" --lookup 16 --repeats 5 --prompts 16 --max-tokens 128
