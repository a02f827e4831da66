#!/bin/bash
# Twenty-fourth session, first device call (H200): s22_call2_h200.sh with 40,000 steps instead
# of 48,000, so that a slow machine start (135 steps/s in s21 call 2) still ends inside the
# training's time limit, and without the rollouts cache (~8 GB written for nothing in one
# call). Heads on twice the twenty-first session's prompts (128,000 arithmetic + 128,000
# text), stored bf16, then paired against the shipped heads on 32 x 32 with the agree rule
# and first drafts (7 repeats, target only in the same process).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 440 python3 -m rltlab.draft_heads.lookahead_train --device cuda --out $OUT/heads_v3 \
  --n-arith 128000 --n-text 128000 --steps 40000 --rollout-batch 2048 \
  > $OUT/train.log 2>&1
echo "train rc $?"; tail -1 $OUT/train.log | cut -c1-1500
tree_bench heads_v3_32 150 --only "chain K=4" --budgets --gemv-rows 64 --chains 1 \
  --engine-compile on --lookup 10 --adaptive-lookup agree --first-drafts \
  --also-heads $OUT/heads_v3 --repeats 7
