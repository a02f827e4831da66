#!/bin/bash
# Tenth session, call 3 (H200): call 2 measured W7's decode phase on a fresh engine at 10,989
# tok/s (decode gain over W6 1.375, as in the eighth session), while call 1's paired bench,
# whose decode phases come after 20 closed loops on one engine, read 1.28 and 63.4% of the
# ideal e2e gain. Does a closed loop leave the engine slower for W7, and in which part (GPU
# time in graphs, exit work, host idle)? Decode phases before and after closed loops, one engine.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 300 python3 docs/experiments/scripts/w7_gpu_time_h200.py --sequence W6 W7 \
  loop:W7 loop:W6 loop:W7 loop:W6 W6 W7 > $OUT/w7_after_loops.log 2>&1
echo "rc $?"; grep -E "^(W[67]|loop)" $OUT/w7_after_loops.log | cut -c1-330
