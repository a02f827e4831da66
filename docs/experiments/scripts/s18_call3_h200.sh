#!/bin/bash
# For the eighteenth session's third device call (H200): whole-prompt steps (on by default since
# this session) in closed loops at the Ouro-1.4B shape (bf16, random weights). (1) W7 arms on one
# engine, prefill graphs on in both, whole-prompt steps on / off, 4 paired rounds; (2) the
# standard W7/W6 paired bench at the engine's defaults (6 loops), against the twelfth session's
# median 83.4% of the ideal savings.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 320 python3 docs/experiments/scripts/w7_admission_h200.py --arms W7+graphs=4096 \
  W7+graphs=4096+whole=0 --rounds 4 > $OUT/w7_whole.log 2>&1
echo "w7 arms rc $?"; grep -vE "it/s|round/s" $OUT/w7_whole.log | tail -6 | cut -c1-2500
tail -1 $OUT/w7_whole.log > $OUT/w7_whole.json
timeout 240 python3 -m rltlab.bench.paired --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --pair W7/W6 --modes graph --loops 6 --out $OUT/paired_w7_w6.json > $OUT/paired_w7_w6.log 2>&1
echo "paired W7/W6 rc $?"; grep "end to end\|Error\|error" $OUT/paired_w7_w6.log | tail -4 | cut -c1-1500
