#!/bin/bash
# For the twenty-first session's first device call (H200): lookahead heads retrained on more of
# the target's own rollouts. The shipped heads (artifacts/ouro-tiny/draft_heads/lookahead_h4)
# saw 28,800 prompts (8,000 arithmetic, 24,000 text) 29 times over, and heads 1-3 peaked at a
# quarter to a half of their 120 s (best_step 5,620 / 8,491 / 11,606 of 23,532): overfit. The
# held-out set is half arithmetic, where tau was 2.5 against 3.65 on text. So: 64,000
# arithmetic + 64,000 text prompts (8x the arithmetic rollouts, 2.7x the text), 30,000 steps,
# with rltlab.draft_heads.lookahead_train; then the new heads against the shipped ones, paired
# in one process (rltlab.bench.tree_spec --also-heads), chain K = 4 + lookup 10 (always and
# adaptive) on 32 x 32, and lookup 16 on 16 x 128.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 290 python3 -m rltlab.draft_heads.lookahead_train --device cuda --out $OUT/heads_v2 \
  --n-arith 64000 --n-text 64000 --steps 30000 > $OUT/train.log 2>&1
echo "train rc $?"; tail -2 $OUT/train.log | cut -c1-1500
BENCH=(--only "chain K=4" --budgets --gemv-rows 64 --chains 1 --engine-compile on
       --adaptive-lookup --also-heads $OUT/heads_v2)
tree_bench heads_32 160 "${BENCH[@]}" --lookup 10 --repeats 11
tree_bench heads_128 100 "${BENCH[@]}" --lookup 16 --repeats 5 --prompts 16 --max-tokens 128
