#!/bin/bash
# Twenty-seventh session, first device call (any GPU: training, no timing): lookahead heads on
# twice the shipped heads' prompts (256,000 + 256,000, against 128,000 + 128,000 for heads_v3),
# their steps ended by the clock (--time-limit) so the call's limit cannot kill the run before
# the heads are saved. The twenty-fifth session's rollouts of 384,000 prompts took ~208 s on an
# H100 (docs/benchmarks/2026-12-05-s25-h100.md); 512,000 should take ~280 s, then 190 s of
# steps. Their tau is then replayed on the CPU (greedy tokens do not depend on the device)
# before any H200 time is spent timing them.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 585 python3 -m rltlab.draft_heads.lookahead_train --device cuda --out $OUT/heads_v5 \
  --n-arith 256000 --n-text 256000 --steps 80000 --time-limit 190 --rollout-batch 2048 \
  > $OUT/train.log 2>&1
echo "train rc $?"; tail -1 $OUT/train.log | cut -c1-1500
ls -la $OUT/heads_v5
