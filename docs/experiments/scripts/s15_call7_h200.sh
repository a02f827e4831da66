#!/bin/bash
# For the fifteenth session's seventh device call (H200): the engine's tree iteration at the
# Ouro-1.4B shape (random weights, bf16; tree_shape_cost.py): GPU time per iteration against
# the engine's target-only time per token, and the speedup those costs imply at the taus the
# embedded model reached (a cost model: random weights accept nothing).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 300 python3 docs/experiments/scripts/tree_shape_cost.py --preset ouro-1.4b \
  --dtype bfloat16 --device cuda \
  --trees-from docs/experiments/data/2026-12-03-lookahead-tree-probe-h200.json \
  --budgets 8 16 32 --tau 2.05 2.27 2.46 2.60 > $OUT/tree_shape_cost.log 2>&1
echo "shape cost rc $?"; grep -vE "^W1203|warn|^ *$" $OUT/tree_shape_cost.log | tail -7 | cut -c1-1500
