#!/bin/bash
# Twenty-fifth session, first device call: the heads on 1.5x the prompts of the shipped ones
# (192,000 + 192,000) for up to 60,000 steps, ended by the clock (lookahead_train
# --time-limit), so that the call's limit cannot kill the run before its heads are saved
# (s24_call3 asked the same with a fixed step count and was lost with its machine). Run at
# ba82123 on an H100 with --time-limit 240, its rollouts took ~208 s and the timeout below
# killed it 222 s into its steps (docs/benchmarks/2026-12-05-s25-h100.md): now 150 s.
# Then paired against the shipped heads on 32 x 32 with the agree rule and first drafts,
# target only and target only compiled in the same process (7 repeats). Without
# --launch-early here: its second engine's compiles would not fit the call (call 2 has it).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 430 python3 -m rltlab.draft_heads.lookahead_train --device cuda --out $OUT/heads_v4 \
  --n-arith 192000 --n-text 192000 --steps 60000 --time-limit 150 --rollout-batch 2048 \
  > $OUT/train.log 2>&1
echo "train rc $?"; tail -1 $OUT/train.log | cut -c1-1500
tree_bench heads_v4_32 150 --only "chain K=4" --budgets --gemv-rows 64 --chains 1 \
  --engine-compile on --lookup 10 --adaptive-lookup agree --first-drafts \
  --also-heads $OUT/heads_v4 --repeats 7
