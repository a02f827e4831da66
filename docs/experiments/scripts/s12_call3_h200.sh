#!/bin/bash
# Twelfth session, call 3 (H200). Call 2's W7/W6 (10 rounds) ran past its 350 s limit in its
# 10th round (~29.4 s a round, ~86 s before the first) and left no JSON: here 8 rounds with room
# to spare (its --out is now rewritten after every round). Then the engine against round steps with gather prefill on the GPU (fp32, the
# embedded model), now that bucketed prefill graphs are on by default there.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 400 python3 -m rltlab.bench.paired --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --pair W7/W6 --modes graph --loops 8 --out $OUT/paired_w7_w6.json > $OUT/paired_w7_w6.log 2>&1
echo "paired W7/W6 rc $?"; grep "end to end\|Error\|error" $OUT/paired_w7_w6.log | tail -4 | cut -c1-1500
timeout 90 python3 docs/experiments/scripts/chain_exactness.py --device cuda \
  --kinds trace,trace-greedy > $OUT/chain_exactness.log 2>&1
echo "chain_exactness rc $?"; tail -7 $OUT/chain_exactness.log | cut -c1-1200
