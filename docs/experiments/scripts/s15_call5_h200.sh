#!/bin/bash
# For the fifteenth session's fifth device call (H200): where the engine's tree decoding spends
# its wall time against target-only decoding (tree_engine_profile.py: host timers around the
# engine's steps, the tree program's replay and the prefill).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 200 python3 docs/experiments/scripts/tree_engine_profile.py --device cuda \
  > $OUT/tree_engine_profile.log 2>&1
echo "profile rc $?"; grep -vE "^W1203|warn|^ *$" $OUT/tree_engine_profile.log | tail -5 | cut -c1-900
