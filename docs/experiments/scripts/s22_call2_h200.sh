#!/bin/bash
# Prepared in the twenty-second session for a later device call (H200), not run there (no
# device was lent): the twenty-first session's heads were still gaining at their last step
# (best_step = 24,000 for all four), so train on twice the prompts for twice the steps, stored
# bf16 (under the 16 MiB a returned file may hold), then pair them against the shipped heads on
# 32 x 32 with the agree rule and first drafts. Expected: ~90 s of rollouts, ~240 s of steps.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 400 python3 -m rltlab.draft_heads.lookahead_train --device cuda --out $OUT/heads_v3 \
  --n-arith 128000 --n-text 128000 --steps 48000 --rollout-batch 2048 \
  --rollouts-cache /tmp/rollouts_v3.pt > $OUT/train.log 2>&1
echo "train rc $?"; tail -1 $OUT/train.log | cut -c1-1500
tree_bench heads_v3_32 150 --only "chain K=4" --budgets --gemv-rows 64 --chains 1 \
  --engine-compile on --lookup 10 --adaptive-lookup agree --first-drafts \
  --also-heads $OUT/heads_v3 --repeats 9
