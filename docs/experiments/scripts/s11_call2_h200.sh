#!/bin/bash
# Eleventh session, call 2 (H200): where a W7 closed loop's time goes against its decode phase
# and W6's loop. Call 1: W7's decode phase does not slow after closed loops (11,014 -> 10,998
# tok/s), and batching admissions (round_window_admit 8, 32) lost 13%; so split the loops
# themselves: GPU time in windows, in prefill steps, idle, and the round steps they ran.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 400 python3 docs/experiments/scripts/w7_gpu_time_h200.py --sequence W6 W7 \
  loop:W6 loop:W7 loop:W6 loop:W7 loop:W6 loop:W7 > $OUT/w7_loop_split.log 2>&1
echo "rc $?"; grep -E "^(W[67]|loop)" $OUT/w7_loop_split.log | cut -c1-600
tail -1 $OUT/w7_loop_split.log > $OUT/w7_loop_split.json
