#!/bin/bash
# Thirty-first session, first device call (asked for as nvidia-h200): LLMEngine.step chaining
# the next prompt's step where a step ends the last running request, paired against one step
# a call on the claim's workload (chained_step_ab.py: four target-only rows and the claimed
# tree config, both modes, 15 repeats); then the device loop's own cost a program on
# stand-in programs (device_loop_overhead.py, unrun since the thirtieth session). Ran at
# 32e63df; the chaining was reverted after it (043dabc), and chained_step_ab.py with it:
# git show 32e63df:docs/experiments/scripts/chained_step_ab.py.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 300 python3 docs/experiments/scripts/chained_step_ab.py --device cuda --repeats 15 \
  > $OUT/chained_step_ab.log 2>&1; echo "chained rc $?"
grep -vE "^W1204|warn|it/s|s/it|repeat/s|run/s" $OUT/chained_step_ab.log | tail -8 | cut -c1-300
timeout 90 python3 docs/experiments/scripts/device_loop_overhead.py --device cuda \
  > $OUT/device_loop_overhead.log 2>&1; echo "overhead rc $?"; tail -3 $OUT/device_loop_overhead.log | cut -c1-1500
