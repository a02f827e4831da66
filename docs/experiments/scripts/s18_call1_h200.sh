#!/bin/bash
# For the eighteenth session's first device call (H200): whole-prompt steps
# (rltlab.engine.prompt_step, EngineConfig.whole_prompt_steps). Where the wall time goes
# (tree_engine_profile.py, host timers) with prompts in one step and in R round steps, then the
# paired bench: target only (whole-prompt steps, the baseline) against target only with
# round-step prompts and chain K = 4 with lookup chains of 0 / 8 / 16 (gemv_rows = 64, glue
# compiled), 32 x 32 (9 repeats) and 16 x 128 (7 repeats).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
for shape in "32 32" "16 128"; do
  PROFILE_CUT=3000 tree_profile $shape 150 --gemv-rows 64 --compile --only "chain K=4" \
    --lookup 0 8 16 --prompt-steps whole rounds
done
BENCH=(--only "chain K=4" --budgets --lookup 0 8 16 --gemv-rows 64 --chains 1
       --engine-compile on --round-step-prompts)
tree_bench whole_32 150 "${BENCH[@]}" --repeats 9
tree_bench whole_128 170 "${BENCH[@]}" --repeats 7 --prompts 16 --max-tokens 128
