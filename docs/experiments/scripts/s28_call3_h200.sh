#!/bin/bash
# Twenty-eighth session: the claim's 32 x 32 rows alone (s27_call3_h200.sh's second part, 15
# repeats), asked for on the H200 kind again; the engine is 96d1896's (prompt_rows reverted).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
tree_bench claim_32 240 --only "chain K=4" --budgets --gemv-rows 64 --chains 1 \
  --engine-compile on --lookup 10 --adaptive-lookup agree --first-drafts --launch-early \
  --repeats 15
