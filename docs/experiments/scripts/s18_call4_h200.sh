#!/bin/bash
# For the eighteenth session's fourth device call (H200), run at 9ceeae1: the tree path after
# whole-prompt steps and with a request's first iteration drafting from token 0's state (that
# change was reverted after call 5 measured it slower, paired; at HEAD this runs without it), paired
# against target only (which takes whole-prompt steps too): chain K = 4 with lookup chains of
# 0 / 6 / 8 on 32 x 32 (9 repeats) and 0 / 16 on 16 x 128 (7 repeats), gemv_rows = 64, glue
# compiled.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
BENCH=(--only "chain K=4" --budgets --gemv-rows 64 --chains 1 --engine-compile on)
tree_bench first_32 150 "${BENCH[@]}" --lookup 0 6 8 --repeats 9
tree_bench first_128 150 "${BENCH[@]}" --lookup 0 16 --repeats 7 --prompts 16 --max-tokens 128
