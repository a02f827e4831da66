#!/bin/bash
# For the fourteenth session's fifth device call (H200): the tree bench again, first with no
# torch.compile'd config, then with the shipped tree also compiled. s14_call4's bench gave tau
# ~1.2 for every tree, while the decoder alone on the same GPU gives the CPU's tau in every
# step of that bench's sequence (s14_call6: 2.565 for the shipped tree).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
for v in plain compiled; do
  extra=""; [ $v = compiled ] && extra="--compile-nodes 16"
  timeout 250 python3 -m rltlab.bench.tree_spec --device cuda --repeats 5 \
    --trees-from docs/experiments/data/2026-12-03-lookahead-tree-probe-h200.json \
    --budgets 8 32 $extra --out $OUT/tree_spec_$v.json > $OUT/tree_spec_$v.log 2>&1
  echo "tree_spec $v rc $?"; grep -vE "^W1203|warn|^ *$" $OUT/tree_spec_$v.log | tail -9 | cut -c1-300
done
