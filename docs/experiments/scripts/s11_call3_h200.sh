#!/bin/bash
# Eleventh session, call 3 (H200): what one prefill step costs against its size (call 2: W7's
# closed loop spends 0.2-0.44 s more than W6's in prefill steps for the same prompts, admitting
# its second wave in 7 small batches). Waves of 1-128 prompts, synchronised steps, and a
# profile of a 16-prompt wave.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 300 python3 docs/experiments/scripts/prefill_step_cost_h200.py > $OUT/prefill_step_cost.log 2>&1
echo "rc $?"; grep -vE "it/s" $OUT/prefill_step_cost.log | tail -40 | cut -c1-3000
tail -1 $OUT/prefill_step_cost.log > $OUT/prefill_step_cost.json
