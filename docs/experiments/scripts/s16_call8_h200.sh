#!/bin/bash
# For the sixteenth session's eighth device call (H200): the tf32x3 tensor-core probe against
# cuBLAS and the FMA rows, fp32 at the embedded model's shapes, 5 / 16 / 37 rows.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 130 python3 docs/experiments/scripts/gemv_tf32x3_probe.py --rows 5 16 37 \
  > $OUT/tf32x3_probe.log 2>&1
echo "probe rc $?"; grep -E "^rows" $OUT/tf32x3_probe.log | cut -c1-900
