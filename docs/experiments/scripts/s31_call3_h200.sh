#!/bin/bash
# Thirty-first session, third device call (asked for as nvidia-h200): the tree's first leaf
# writing in place (no prefix copy and no commit in a program of its rows alone), paired
# against every program copying and committing (in_place_ab.py: four target-only rows and
# the claimed tree config both ways, 15 repeats); then the claimed config's kernels a program
# (tree_kernel_profile.py, as s28_call4_h200.sh). Ran in parts on one warm H200 (start S):
# its first command as call 3, its second as call 6 (docs/experiments/data/2026-12-06-s31.json).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 300 python3 docs/experiments/scripts/in_place_ab.py --device cuda --repeats 15 \
  > $OUT/in_place_ab.log 2>&1; echo "in place rc $?"
grep -E "^claim|^in place" $OUT/in_place_ab.log | cut -c1-400
timeout 200 python3 docs/experiments/scripts/tree_kernel_profile.py --device cuda --lookup 10 \
  --adaptive-lookup agree --first-drafts --top 40 > $OUT/kernel_profile.log 2>&1
echo "kernel profile rc $?"; grep -E "^==" $OUT/kernel_profile.log
