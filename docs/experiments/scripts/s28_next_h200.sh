#!/bin/bash
# Planned in the twenty-eighth session for the next one's first device call (H200; unrun):
# device_loop_ab.py, the request's tree programs looped on the device (CUDA graph WHILE and
# IF-ELSE nodes, graph_while_probe.cu) against TreeGraph.run's host loop, paired in one process
# (11 repeats); then the claim's 32 x 32 rows at this code on the same start.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 300 python3 docs/experiments/scripts/device_loop_ab.py --device cuda \
  > $OUT/device_loop_ab.log 2>&1
echo "device_loop_ab rc $?"; grep -v "^W1204\|warn" $OUT/device_loop_ab.log | tail -5 | cut -c1-1500
bash "$(dirname "$0")/s28_call3_h200.sh" | tail -n +3
