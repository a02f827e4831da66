#!/bin/bash
# For the eighteenth session's sixth device call (H200): whole prompts' inputs built with one
# host->device copy (ModelRunner._whole_prompt_inputs, now fused_prefill.whole_prompt_inputs).
# The prompt step profile again (against call 2's 1.44 ms a prompt), then the paired bench at
# HEAD on 32 x 32: target only against round-step prompts and chain K = 4 + lookup 8 (9
# repeats).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 120 python3 docs/experiments/scripts/prompt_step_profile.py --device cuda --prompts 32 \
  > $OUT/prompt_step_profile.log 2>&1
echo "profile rc $?"; grep -E "^(whole|rounds) " $OUT/prompt_step_profile.log | cut -c1-1200
tree_bench lean_32 150 --only "chain K=4" --budgets --lookup 0 8 --gemv-rows 64 --chains 1 \
  --engine-compile on --round-step-prompts --repeats 9
