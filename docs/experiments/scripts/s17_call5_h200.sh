#!/bin/bash
# For the seventeenth session's fifth device call (H200): where the wall time goes on 32 x 32
# (host timers, tree_engine_profile.py), target-only against chain K = 4 with and without a
# lookup chain of 8, gemv_rows = 64, glue compiled; then the same on 16 x 128 once more.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
for shape in "32 32" "16 128"; do
  tree_profile $shape 120 --gemv-rows 64 --compile --only "chain K=4" --lookup 0 8 16
done
