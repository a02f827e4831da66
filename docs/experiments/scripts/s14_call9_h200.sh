#!/bin/bash
# For the fourteenth session's last device call (H200, ~160 s left): call 4's bench exactly
# (engine + two torch.compile'd trees + B = 64 in one process), one repeat, to see whether its
# low tau comes back. Calls 5-8 (without that combination) did not reproduce it.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 140 python3 -m rltlab.bench.tree_spec --device cuda --repeats 1 \
  --trees-from docs/experiments/data/2026-12-03-lookahead-tree-probe-h200.json \
  --budgets 8 32 64 --compile-nodes 16 32 --out $OUT/tree_spec_call4_again.json \
  > $OUT/tree_spec.log 2>&1
echo "tree_spec rc $?"; grep -vE "^W1203|warn|^ *$" $OUT/tree_spec.log | tail -12 | cut -c1-200
