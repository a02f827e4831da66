#!/bin/bash
# Twenty-fourth session, second device call (H200; it found the first call's machine still warm,
# so it ran on the same machine start): the heads in $HEADS (default: the shipped lookahead_h4)
# with every lookup rule, with and without first drafts, paired against target only in one
# process: 32 x 32 (lookup 10, 9 repeats), 16 x 128 (lookup 16, 5 repeats) and 128 x 32 (lookup
# 10, 3 repeats; the 32 x 32 prompts are its first 32).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
HEADS_ARG=(${HEADS:+--heads "$HEADS"})
COMMON=(--only "chain K=4" --budgets --gemv-rows 64 --chains 1 --engine-compile on
        --first-drafts "${HEADS_ARG[@]}")
tree_bench rules_32 170 "${COMMON[@]}" --lookup 10 --adaptive-lookup hits agree --repeats 9
tree_bench rules_16x128 150 "${COMMON[@]}" --lookup 16 --adaptive-lookup agree --repeats 5 \
  --prompts 16 --max-tokens 128
tree_bench rules_128x32 170 "${COMMON[@]}" --lookup 10 --adaptive-lookup agree --repeats 3 \
  --prompts 128 --max-tokens 32
