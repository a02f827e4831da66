#!/bin/bash
# For the twenty-first session's second device call (H200): s21_call1_h200.sh again, after its
# training was stopped at 290 s while ranking the calibration rollouts one rollout a pass
# (lookahead_train.true_ranks now ranks every position at once, in chunks). Rollouts took
# ~105 s and the 30,000 steps 144 s there. Then the new heads against the shipped ones on
# 32 x 32, paired in one process; 16 x 128 waits for a later call.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 330 python3 -m rltlab.draft_heads.lookahead_train --device cuda --out $OUT/heads_v2 \
  --n-arith 64000 --n-text 64000 --steps 30000 > $OUT/train.log 2>&1
echo "train rc $?"; tail -1 $OUT/train.log | cut -c1-1500
tree_bench heads_32 200 --only "chain K=4" --budgets --gemv-rows 64 --chains 1 \
  --engine-compile on --adaptive-lookup --also-heads $OUT/heads_v2 --lookup 10 --repeats 11
