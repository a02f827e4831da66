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
  set -- $shape
  timeout 150 python3 docs/experiments/scripts/tree_engine_profile.py --device cuda \
    --gemv-rows 64 --compile --only "chain K=4" --lookup 0 8 16 --prompts $1 --max-tokens $2 \
    --prompt-steps whole rounds > $OUT/profile_$1x$2.log 2>&1
  echo "profile $1 x $2 rc $?"; tail -1 $OUT/profile_$1x$2.log | cut -c1-3000
done
BENCH=(--only "chain K=4" --budgets --lookup 0 8 16 --gemv-rows 64 --chains 1
       --engine-compile on --round-step-prompts)
tree_bench whole_32 150 "${BENCH[@]}" --repeats 9
tree_bench whole_128 170 "${BENCH[@]}" --repeats 7 --prompts 16 --max-tokens 128
