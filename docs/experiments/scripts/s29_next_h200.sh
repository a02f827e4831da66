#!/bin/bash
# Planned in the twenty-ninth session (no device was lent; unrun) for the next one's first
# device call (H200): the claim's 32 x 32 rows with and without EngineConfig.device_loop (the
# library's loop of tree programs on the device, rltlab/engine/device_loop.py), paired in one
# run (15 repeats); each device-loop row's "device_loop" says how many requests it took, or why
# it could not be built (then those rows ran the host loop). The prototype's A/B follows where
# time is left (device_loop_ab.py, s28_next_h200.sh's first part).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
nvcc --version | tail -1
tree_bench claim_32_device_loop 420 --only "chain K=4" --budgets --gemv-rows 64 --chains 1 \
  --engine-compile on --lookup 10 --adaptive-lookup agree --first-drafts --launch-early \
  --device-loop --repeats 15
python3 -c "import json; [print(r['config'], r.get('device_loop')) for r in
  json.load(open('$OUT/claim_32_device_loop.json'))['rows'] if 'device_loop' in r]"
