#!/bin/bash
# For the twenty-first session's third device call (H200): s21_call2_h200.sh again. There the
# machine ran slower (rollouts 140 s at 512 prompts a batch, 135-160 steps/s) and training was
# stopped at 330 s, 70% through. Now the rollouts decode 2,048 prompts a batch (launch-bound:
# ~4x fewer steps) and the heads train 24,000 steps. Then the new heads against the shipped
# ones on 32 x 32, paired in one process.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 380 python3 -m rltlab.draft_heads.lookahead_train --device cuda --out $OUT/heads_v2 \
  --n-arith 64000 --n-text 64000 --steps 24000 --rollout-batch 2048 > $OUT/train.log 2>&1
echo "train rc $?"; tail -1 $OUT/train.log | cut -c1-1500
tree_bench heads_32 180 --only "chain K=4" --budgets --gemv-rows 64 --chains 1 \
  --engine-compile on --adaptive-lookup --also-heads $OUT/heads_v2 --lookup 10 --repeats 9
