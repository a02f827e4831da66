#!/bin/bash
# For the seventeenth session's fifth device call (H200): where the wall time goes on 32 x 32
# (host timers, tree_engine_profile.py), target-only against chain K = 4 with and without a
# lookup chain of 8, gemv_rows = 64, glue compiled; then the same on 16 x 128 once more.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
for shape in "32 32" "16 128"; do
  set -- $shape
  timeout 120 python3 docs/experiments/scripts/tree_engine_profile.py --device cuda \
    --gemv-rows 64 --compile --only "chain K=4" --lookup 0 8 16 --prompts $1 --max-tokens $2 \
    > $OUT/profile_$1x$2.log 2>&1
  echo "profile $1 x $2 rc $?"; tail -1 $OUT/profile_$1x$2.log | cut -c1-2500
done
