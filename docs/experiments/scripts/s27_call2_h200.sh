#!/bin/bash
# Twenty-seventh session, second device call (H200): where the device idles at c = 1 on
# 32 x 32, target only against the claimed tree config (chain K = 4 + lookup 10 by agreement,
# first drafts, early launches, compiled, gemv_rows 64): gpu_idle_timeline.py's timing events
# around every call that queues device work, then tree_engine_profile.py's host timers for
# the same configs (the twenty-sixth session's lead: the gap between a prompt step and the
# first launch, for both); then the claim on this start (32 x 32).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 240 python3 docs/experiments/scripts/gpu_idle_timeline.py --device cuda \
  > $OUT/idle_32x32.log 2>&1
echo "idle rc $?"; grep -v "^W1204\|warn" $OUT/idle_32x32.log | tail -4 | cut -c1-2500
PROFILE_CUT=3500 tree_profile 32 32 200 --gemv-rows 64 --compile --budgets --only "chain K=4" \
  --lookup 10 --adaptive-lookup agree --first-drafts --launch-early
# the claim on this start too (s25_call2_h200.sh's 32 x 32 part: every row with and without
# early launches, 15 repeats)
tree_bench claim_32 240 --only "chain K=4" --budgets --gemv-rows 64 --chains 1 \
  --engine-compile on --lookup 10 --adaptive-lookup agree --first-drafts --launch-early \
  --repeats 15
