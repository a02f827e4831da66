#!/bin/bash
# For the twentieth session's fifth device call (H200): the few-row FMA tiles of the tree
# program's rounds (q/k/v with RoPE, o, gate/up, down), swept where they run: the rounds over
# the lead program's 16 rows and the heads-only program's 5, captured as CUDA graphs
# (tree_rows_tiles.py; target-only decoding runs one-row tiles and does not see them).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 480 python3 docs/experiments/scripts/tree_rows_tiles.py > $OUT/tiles.log 2>&1
echo "tiles rc $?"; grep -vE "^W1204|warn|^\{" $OUT/tiles.log | cut -c1-300
