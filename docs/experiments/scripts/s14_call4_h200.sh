#!/bin/bash
# For the fourteenth session's second device call (H200), issue 16's 2.0x lossless goal at c = 1:
# tree speculative decoding with the lookahead heads trained in call 3
# (artifacts/ouro-tiny/draft_heads/lookahead_h4, rltlab.engine.tree_spec) against the paged
# engine's target-only decoding, end to end, embedded model v4 in fp32, 32 held-out prompts,
# 32 new tokens, greedy, 7 interleaved repeats; trees of 4 (chain) to 64 nodes picked in call
# 3, each as one CUDA graph of the reference modules, and some also under torch.compile.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 560 python3 -m rltlab.bench.tree_spec --device cuda --repeats 7 \
  --trees-from docs/experiments/data/2026-12-03-lookahead-tree-probe-h200.json \
  --budgets 8 32 64 --compile-nodes 16 32 --out $OUT/tree_spec.json \
  > $OUT/tree_spec.log 2>&1
echo "tree_spec rc $?"; grep -vE "^W1203|^ *$" $OUT/tree_spec.log | tail -16 | cut -c1-600
