#!/bin/bash
# For the nineteenth session's fifth device call (H200): the tree program's output copied to
# pinned host memory right behind it (the read-back waits for that copy, not for a new one).
# Where a whole-prompt step's time goes now (prompt_step_profile.py), where 32 x 32's time goes
# with chain K = 4 + lookup 10, adaptive (host timers), then the paired benches: 32 x 32 with
# lookup 10 always and adaptive (15 repeats) and 16 x 128 with lookup 16 both ways (5 repeats);
# spec_pipeline 16 (the default), gemv_rows = 64, glue compiled.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 90 python3 docs/experiments/scripts/prompt_step_profile.py --device cuda --prompts 32 \
  > $OUT/prompt_step_profile.log 2>&1
echo "prompt profile rc $?"; grep -E "^(whole|rounds) " $OUT/prompt_step_profile.log | cut -c1-1500
PROFILE_CUT=3000 tree_profile 32 32 120 --gemv-rows 64 --compile --only "chain K=4" --lookup 10 \
  --adaptive-lookup
BENCH=(--only "chain K=4" --budgets --gemv-rows 64 --chains 1 --engine-compile on
       --adaptive-lookup)
tree_bench pinned_32 200 "${BENCH[@]}" --lookup 10 --repeats 15
tree_bench pinned_128 150 "${BENCH[@]}" --lookup 16 --repeats 5 --prompts 16 --max-tokens 128
