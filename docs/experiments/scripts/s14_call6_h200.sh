#!/bin/bash
# For the fourteenth session's fourth device call (H200): which step of the tree bench's
# sequence (engine built, engine generating, torch.compile) lowers the tree decoder's tau on the
# GPU (docs/experiments/scripts/tree_spec_bench_check.py).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 300 python3 docs/experiments/scripts/tree_spec_bench_check.py > $OUT/bench_check.log 2>&1
echo "check rc $?"; grep -vE "^W1203|warn" $OUT/bench_check.log | tail -16 | cut -c1-1200
