#!/bin/bash
# For the nineteenth session's first device call (H200): pipelined tree programs
# (EngineConfig.spec_pipeline: the next program launched from the device's state as soon as
# the last one's read-back shows the sequence goes on, so the host's token bookkeeping overlaps
# its GPU time). Where 32 x 32's time goes with spec_pipeline 16 (tree_engine_profile.py, host
# timers), then the paired bench: chain K = 4 with lookup chains of 0 / 8 at spec_pipeline 1
# and 16, 32 x 32 (9 repeats), and chain K = 4 + lookup 16 on 16 x 128 (7 repeats); gemv_rows
# = 64, glue compiled, as in the eighteenth session.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
PROFILE_CUT=3000 tree_profile 32 32 120 --gemv-rows 64 --compile --only "chain K=4" \
  --lookup 8 --pipeline 16
BENCH=(--only "chain K=4" --budgets --gemv-rows 64 --chains 1 --pipelines 1 16
       --engine-compile on)
tree_bench pipeline_32 170 "${BENCH[@]}" --lookup 0 8 --repeats 9
tree_bench pipeline_128 170 "${BENCH[@]}" --lookup 16 --repeats 7 --prompts 16 \
  --max-tokens 128
