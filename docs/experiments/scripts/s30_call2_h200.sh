#!/bin/bash
# Thirtieth session, second device call (asked for as nvidia-h200): the device loop with its
# decide step as one Triton kernel (kernels.loop_decide). First the decide step's device time,
# torch ops against the kernel (loop_decide_timing.py); then the claim's 32 x 32 rows with and
# without the device loop, paired in one run (15 repeats), as s29_next_h200.sh (the first call:
# the torch-ops decide made the loop 7% slower than the host loop on an H100).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 60 python3 docs/experiments/scripts/loop_decide_timing.py --device cuda \
  > $OUT/loop_decide_timing.log 2>&1; echo "decide timing rc $?"; tail -3 $OUT/loop_decide_timing.log
tree_bench claim_32_device_loop 420 --only "chain K=4" --budgets --gemv-rows 64 --chains 1 \
  --engine-compile on --lookup 10 --adaptive-lookup agree --first-drafts --launch-early \
  --device-loop --repeats 15
python3 -c "import json; [print(r['config'], r.get('device_loop')) for r in
  json.load(open('$OUT/claim_32_device_loop.json'))['rows'] if 'device_loop' in r]"
