#!/bin/bash
# For the twentieth session's third device call (H200): tree programs launched one ahead (each
# before the last one is read back; the one in flight dropped where the sequence ends) against
# the lean-rounds commit before it (2d7b384, carried as .ab/: git archive 2d7b384 rltlab
# kernels engine_patches), each in its own process on this machine start: the paired 32 x 32
# bench (chain K = 4, with lookup 10, always and adaptive; 15 and 9 repeats), then 16 x 128
# with lookup 16 (5 repeats) and the host-timer profile of 32 x 32.
# Ran on 2d7b384 with docs/experiments/data/2026-12-04-s20-one-ahead.diff applied (git apply);
# that change was reverted after this call (a negative result).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
BENCH=(--only "chain K=4" --budgets --gemv-rows 64 --chains 1 --engine-compile on
       --adaptive-lookup)
tree_bench ahead_32 240 "${BENCH[@]}" --lookup 10 --repeats 15
(cd .ab && ln -sfn ../kernels rltlab/kernels && ln -sfn ../engine_patches rltlab/engine_patches \
   && ln -sfn ../artifacts artifacts && PYTHONPATH=$PWD tree_bench lean_32 200 "${BENCH[@]}" \
   --lookup 10 --repeats 9)
tree_bench ahead_128 200 "${BENCH[@]}" --lookup 16 --repeats 5 --prompts 16 --max-tokens 128
PROFILE_CUT=3000 tree_profile 32 32 120 --gemv-rows 64 --compile --only "chain K=4" --lookup 10 \
  --adaptive-lookup
