#!/bin/bash
# Prepared in the twenty-second session for the next device call (H200), not run there (no
# device was lent): chain K = 4 + lookup with the two adaptive rules (hits, agree), with and
# without first drafts, paired against target only in one process; 32 x 32 (lookup 10, 9
# repeats), then 16 x 128 (lookup 16, 5 repeats). The CPU replay's expectations for it
# (tau, rows, cost model): docs/experiments/data/2026-12-04-s22-tree-sim-cpu.json.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
tree_bench rules_32 240 --only "chain K=4" --budgets --gemv-rows 64 --chains 1 \
  --engine-compile on --lookup 10 --adaptive-lookup hits agree --first-drafts --repeats 9
tree_bench rules_128 240 --only "chain K=4" --budgets --gemv-rows 64 --chains 1 \
  --engine-compile on --lookup 16 --adaptive-lookup hits agree --first-drafts --repeats 5 \
  --prompts 16 --max-tokens 128
