#!/bin/bash
# For the nineteenth session's second device call (H200): spec_pipeline 16 is now the default.
# The paired 32 x 32 bench at HEAD, spec_pipeline 1 against 16, with chain K = 4 and lookup
# chains of 0 / 2 / 3 / 8: with lookup 2 the tree has 8 rows (one 8-row block of the FMA
# GEMVs) against 9 / 14 rows (16-row blocks) for lookup 3 / 8, so the rows' cost against tau
# (gemv_rows = 64, glue compiled; 9 repeats).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
tree_bench rows_32 200 --only "chain K=4" --budgets --gemv-rows 64 --chains 1 --pipelines 1 16 \
  --engine-compile on --lookup 0 2 3 8 --repeats 9
