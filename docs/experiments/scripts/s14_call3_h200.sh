#!/bin/bash
# For the fourteenth session's first device call (H200; s14_call{1,2} are the padded-prefill
# calls prepared earlier and still unrun). Two things:
# 1. The thirteenth session's last tidy (attention_tiles.attend_range shared by the decode and
#    shared-prefix kernels; token windows planning their groups with their index) on a GPU:
#    shared-prefix exactness on the embedded model (fp32, on against off), then W5 (2 paired
#    rounds) and W1 at the Ouro-1.4B shape.
# 2. Issue 16: lookahead heads on h_4 trained on ~10x the CPU probe's rollouts, teacher-forced
#    tree tau on the held-out rollouts, and the cost of a full-depth pass over N rows against
#    one row (docs/experiments/scripts/lookahead_tree_probe.py).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 130 python3 docs/experiments/scripts/shared_prefix_exactness.py --device cuda \
  > $OUT/shared_prefix_exactness.log 2>&1
echo "exactness rc $?"; tail -4 $OUT/shared_prefix_exactness.log | cut -c1-600
timeout 180 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W5 W1 --modes graph --w5-rounds 2 --out $OUT/engine_w5_w1.json \
  > $OUT/engine.log 2>&1
echo "engine rc $?"; grep -E "^W[15] " $OUT/engine.log | cut -c1-500
PROBE_OUT=$OUT timeout 260 python3 docs/experiments/scripts/lookahead_tree_probe.py \
  --device cuda --train-seconds 120 > $OUT/tree_probe.log 2>&1
echo "tree probe rc $?"; grep -vE "^  gen" $OUT/tree_probe.log | tail -14 | cut -c1-900
