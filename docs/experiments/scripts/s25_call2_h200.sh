#!/bin/bash
# Twenty-fifth session's plan, second device call (H200, on ANOTHER machine start than the
# first: give the first machine back, or let it go idle, before this call): issue 16's last
# item, >= 2.0x lossless at c = 1 on 32 x 32 against both baselines, with the fastest proposer
# measured (chain K = 4 + lookup 10 by agreement, first drafts) and the heads in $HEADS
# (default: the shipped lookahead_h4; the first call's heads_v4 where they won, carried as
# .ab/heads_v4). 15 repeats on 32 x 32, then 5 on 16 x 128 for the same start's figure there;
# every config and both baselines also with their first launch behind the prompt step
# (--launch-early: " early" rows, EngineConfig.launch_behind_prompt, built in the
# twenty-fifth session and not yet timed; vs_faster against the fastest of the four
# target-only rows).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
HEADS_ARG=(${HEADS:+--heads "$HEADS"})
COMMON=(--only "chain K=4" --budgets --gemv-rows 64 --chains 1 --engine-compile on
        --lookup 10 --adaptive-lookup agree --first-drafts --launch-early "${HEADS_ARG[@]}")
tree_bench claim_32 240 "${COMMON[@]}" --repeats 15
tree_bench claim_16x128 150 "${COMMON[@]}" --lookup 16 --repeats 5 --prompts 16 \
  --max-tokens 128
