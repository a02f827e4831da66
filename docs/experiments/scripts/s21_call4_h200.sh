#!/bin/bash
# For the twenty-first session's fourth device call (H200): s21_call3_h200.sh's heads again
# (same recipe and seed), now stored in bf16 (--save-dtype, the default) so that they come back
# (fp32 was 18.9 MB, over the device's 16 MiB a file) and can ship; the bench loads that file.
# Then the new heads against the shipped ones, paired in one process: chain K = 4 + lookup 10
# on 32 x 32 (9 repeats) and lookup 16 on 16 x 128 (5 repeats), always and adaptive.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 300 python3 -m rltlab.draft_heads.lookahead_train --device cuda --out $OUT/heads_v2 \
  --n-arith 64000 --n-text 64000 --steps 24000 --rollout-batch 2048 > $OUT/train.log 2>&1
echo "train rc $?"; tail -1 $OUT/train.log | cut -c1-1500
BENCH=(--only "chain K=4" --budgets --gemv-rows 64 --chains 1 --engine-compile on
       --adaptive-lookup --also-heads $OUT/heads_v2)
tree_bench heads_32 140 "${BENCH[@]}" --lookup 10 --repeats 9
tree_bench heads_128 130 "${BENCH[@]}" --lookup 16 --repeats 5 --prompts 16 --max-tokens 128
