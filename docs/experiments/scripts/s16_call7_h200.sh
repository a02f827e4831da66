#!/bin/bash
# For the sixteenth session's seventh device call (H200): where the wall time of the best
# configuration goes (gemv_rows = 64, compiled glue; chain K = 4 and tree B = 8), beside
# target-only decoding with and without compile, on 16 held-out prompts x 128 new tokens:
# host timers around the engine step, the program's stage and replay (GPU + read-back) and
# the runner's execute (prefill).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 250 python3 docs/experiments/scripts/tree_engine_profile.py --device cuda \
  --gemv-rows 64 --compile \
  --trees-from docs/experiments/data/2026-12-03-lookahead-tree-probe-h200.json --budgets 8 \
  --only "chain K=4" "tree B=8" --prompts 16 --max-tokens 128 > $OUT/profile.log 2>&1
echo "profile rc $?"; grep -E "^(target|chain|tree)" $OUT/profile.log | cut -c1-600
