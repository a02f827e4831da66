#!/bin/bash
# For the twenty-first session's fifth device call (H200): the shipped heads (lookahead_h4,
# retrained in call 4) from the checkout on another machine start: chain K = 4 + lookup 10,
# always and adaptive, 32 x 32, 9 repeats (the session's last device seconds).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
tree_bench last_32 130 --only "chain K=4" --budgets --gemv-rows 64 --chains 1 \
  --engine-compile on --adaptive-lookup --lookup 10 --repeats 9
