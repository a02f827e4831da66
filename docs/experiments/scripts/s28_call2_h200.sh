#!/bin/bash
# Twenty-eighth session, second device call (asks for the H200): short whole-prompt steps as
# static decode rows (EngineConfig.prompt_rows, new) against the fused prefill's graphs, paired
# in one process (prompt_rows_ab.py, 11 repeats); then the idle timeline and the claim's
# 32 x 32 rows (target only now with the trees' gemv_rows) at this code on the same start.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 300 python3 docs/experiments/scripts/prompt_rows_ab.py --device cuda \
  > $OUT/prompt_rows_ab.log 2>&1
echo "prompt_rows_ab rc $?"; grep -v "^W1204\|warn" $OUT/prompt_rows_ab.log | tail -4 | cut -c1-1800
bash "$(dirname "$0")/s27_call3_h200.sh" | tail -n +3
