#!/bin/bash
# Twenty-eighth session, fourth device call (asks for the H200 kind): the kernels of the claimed
# config's tree programs now (tree_kernel_profile.py, agree + first drafts; its last profile,
# s20, predates both), then the claim's 32 x 32 rows (s28_call3_h200.sh).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 200 python3 docs/experiments/scripts/tree_kernel_profile.py --device cuda --lookup 10 \
  --adaptive-lookup agree --first-drafts --top 40 > $OUT/kernel_profile.log 2>&1
echo "kernel profile rc $?"; grep -E "^==" $OUT/kernel_profile.log
bash "$(dirname "$0")/s28_call3_h200.sh" | tail -n +3
