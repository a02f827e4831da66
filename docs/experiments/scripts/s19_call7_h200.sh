#!/bin/bash
# For the nineteenth session's seventh device call (H200): the tree program's glue compiled with
# inductor's combo kernels against the engine's glue, paired in one process
# (glue_combo_ab.py): chain K = 4 + lookup 10 adaptive, 32 x 32, 11 repeats.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 300 python3 docs/experiments/scripts/glue_combo_ab.py --device cuda --lookup 10 \
  --adaptive-lookup --repeats 11 > $OUT/glue_combo_ab.log 2>&1
echo "combo rc $?"; grep -vE "^W1204|warn|^ *$|^\{" $OUT/glue_combo_ab.log | tail -8 | cut -c1-300
tail -1 $OUT/glue_combo_ab.log > $OUT/glue_combo_ab.json
