#!/bin/bash
# Twenty-seventh session, fourth device call (H200 asked; calls 2 and 3 were given H100s):
# whether this torch captures torch.cond / while_loop as CUDA graph conditional nodes (the
# lead for a device-side tree loop), then s27_call3_h200.sh's idle timeline and the claim's
# 32 x 32 rows on this start.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 120 python3 docs/experiments/scripts/graph_conditional_probe.py --device cuda \
  > $OUT/graph_conditional.log 2>&1
echo "probe rc $?"; tail -1 $OUT/graph_conditional.log | cut -c1-2500
bash "$(dirname "$0")/s27_call3_h200.sh" | tail -n +3
