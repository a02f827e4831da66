#!/bin/bash
# For the twentieth session's fourth device call (H200): the engine at HEAD (lean rounds; the
# one-ahead launches of call 3 reverted) on a fresh start: the paired 32 x 32 bench with chain
# K = 4, with lookup 10, always and adaptive, at spec_chain 1 and 2 (11 repeats), then 16 x 128
# with lookup 16 (5 repeats).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
BENCH=(--only "chain K=4" --budgets --gemv-rows 64 --engine-compile on --adaptive-lookup)
tree_bench final_32 300 "${BENCH[@]}" --chains 1 2 --lookup 10 --repeats 11
tree_bench final_128 200 "${BENCH[@]}" --chains 1 --lookup 16 --repeats 5 --prompts 16 \
  --max-tokens 128
