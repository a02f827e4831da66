#!/bin/bash
# Prepared in the twenty-third session for a later device call (H200), not run there (no
# device was lent): the s22_call1 proposers on 128 x 32, four times the 32 x 32 workload's
# prompts (a superset of them). The CPU replay puts it well below 32 x 32 (cost model: agree +
# first drafts 1.718 against 1.976; docs/experiments/data/2026-12-05-s23-rollout-table-cpu.json),
# because its prompts repeat themselves less: this measures how far the 32 x 32 figure carries.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
tree_bench rules_128x32 300 --only "chain K=4" --budgets --gemv-rows 64 --chains 1 \
  --engine-compile on --lookup 10 --adaptive-lookup hits agree --first-drafts --repeats 3 \
  --prompts 128 --max-tokens 32
