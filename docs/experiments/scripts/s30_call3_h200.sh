#!/bin/bash
# Thirtieth session, third device call (asked for as nvidia-h200): the device loop's own cost a
# program on stand-in programs (device_loop_overhead.py: one long kernel, and 137 small ones),
# then the claim's 32 x 32 rows on the host loop alone, as s28_call3_h200.sh (15 repeats): one
# more start for the pooled claim. Unrun: no machine was given after call 2, then the
# session's device time ran out; the next session's first device call.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 90 python3 docs/experiments/scripts/device_loop_overhead.py --device cuda \
  > $OUT/device_loop_overhead.log 2>&1; echo "overhead rc $?"; tail -3 $OUT/device_loop_overhead.log
tree_bench claim_32 240 --only "chain K=4" --budgets --gemv-rows 64 --chains 1 \
  --engine-compile on --lookup 10 --adaptive-lookup agree --first-drafts --launch-early \
  --repeats 15
