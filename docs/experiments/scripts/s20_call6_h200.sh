#!/bin/bash
# For the twentieth session's sixth device call (H200): the 2..8-row q/k/v and o tiles of
# s20_call5 against the tiles before them, paired in one process (tiles_ab.py): 32 x 32 with
# chain K = 4 + lookup 10 adaptive (15 repeats), then 16 x 128 with lookup 16 (5 repeats).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
for shape in "32 32 10 15" "16 128 16 5"; do
  set -- $shape
  timeout 240 python3 docs/experiments/scripts/tiles_ab.py --device cuda --prompts $1 \
    --max-tokens $2 --lookup $3 --adaptive-lookup --repeats $4 > $OUT/tiles_ab_$1x$2.log 2>&1
  echo "tiles_ab $1 x $2 rc $?"; grep -vE "^W1204|warn|^\{|^ *$" $OUT/tiles_ab_$1x$2.log | cut -c1-250
done
