#!/bin/bash
# Twenty-seventh session, third device call (H200; call 2 ran on an H100 with a slow host,
# python_us ~2,300; the twenty-sixth session's H200 had 1,995 / 1,133): gpu_idle_timeline.py
# on 32 x 32 (where the device idles, target only against the claimed tree config), then the
# claim's 32 x 32 rows on the same start (s25_call2_h200.sh's first part, 15 repeats).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 240 python3 docs/experiments/scripts/gpu_idle_timeline.py --device cuda \
  > $OUT/idle_32x32.log 2>&1
echo "idle rc $?"; grep -v "^W1204\|warn" $OUT/idle_32x32.log | tail -1 | cut -c1-3000
tree_bench claim_32 240 --only "chain K=4" --budgets --gemv-rows 64 --chains 1 \
  --engine-compile on --lookup 10 --adaptive-lookup agree --first-drafts --launch-early \
  --repeats 15
