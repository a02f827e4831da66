#!/bin/bash
# For the fourteenth session's third device call (H200): s14_call4's tree decoder accepted few
# drafts on the GPU (tau 1.17 against 2.56 on the CPU, same heads and tree) and cost ~2 ms per
# iteration; docs/experiments/scripts/tree_spec_gpu_check.py locates the first and times the
# second (GPU time of one replay against the host loop's time per iteration).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 400 python3 docs/experiments/scripts/tree_spec_gpu_check.py > $OUT/tree_check.log 2>&1
echo "check rc $?"; grep -vE "^W1203|warn" $OUT/tree_check.log | tail -14 | cut -c1-1500
