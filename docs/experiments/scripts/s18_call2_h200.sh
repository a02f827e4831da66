#!/bin/bash
# For the eighteenth session's second device call (H200): where a whole-prompt step's ~2 ms
# goes at c = 1 (prompt_step_profile.py: 32 held-out prompts, max_tokens = 1, host timers,
# CUDA-event replay times, torch.profiler), round-step prompts as the baseline.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 200 python3 docs/experiments/scripts/prompt_step_profile.py --device cuda --prompts 32 \
  > $OUT/prompt_step_profile.log 2>&1
echo "rc $?"; grep -E "^(whole|rounds) " $OUT/prompt_step_profile.log | cut -c1-2500
grep -B2 -A30 "Self CPU %" $OUT/prompt_step_profile.log | cut -c1-170 | head -130
