#!/bin/bash
# Twenty-eighth session, ninth device call (any GPU: a functional probe and per-iteration
# times, no ratio): graph_while_probe.py, a CUDA graph WHILE node around a torch-captured body
# and around the claimed config's tree program.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 150 python3 docs/experiments/scripts/graph_while_probe.py --device cuda \
  > $OUT/graph_while_probe.log 2>&1
echo "probe rc $?"; grep -v "^W1204\|warn" $OUT/graph_while_probe.log | tail -6 | cut -c1-2000
