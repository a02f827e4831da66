#!/bin/bash
# Twenty-fourth session, third device call (H200, the second's machine start): heads_v3 (256k
# prompts, 40k steps) still gained at their last step, and added 2.3% end to end. So 1.5x the
# prompts (192,000 + 192,000) and 1.5x the steps, paired against heads_v3 (carried in .ab/) on
# 32 x 32 with the agree rule and first drafts, target only in the same process.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 400 python3 -m rltlab.draft_heads.lookahead_train --device cuda --out $OUT/heads_v4 \
  --n-arith 192000 --n-text 192000 --steps 60000 --rollout-batch 2048 > $OUT/train.log 2>&1
echo "train rc $?"; tail -1 $OUT/train.log | cut -c1-1500
tree_bench heads_v4_32 120 --only "chain K=4" --budgets --gemv-rows 64 --chains 1 \
  --engine-compile on --lookup 10 --adaptive-lookup agree --first-drafts --heads .ab/heads_v3 \
  --also-heads $OUT/heads_v4 --repeats 7
