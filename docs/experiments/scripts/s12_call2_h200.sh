#!/bin/bash
# Twelfth session, call 2 (H200): bucketed prefill graphs on by default on CUDA
# (EngineConfig.prefill_graph_tokens None = 4096). The standard paired bench, default mode:
# W7/W6 (10 rounds), then W4/W3 (4 rounds, the pair that met 80% in the fourth session).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 350 python3 -m rltlab.bench.paired --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --pair W7/W6 --modes graph --loops 10 --out $OUT/paired_w7_w6.json > $OUT/paired_w7_w6.log 2>&1
echo "paired W7/W6 rc $?"; grep "end to end\|Error\|error" $OUT/paired_w7_w6.log | tail -4 | cut -c1-1500
timeout 215 python3 -m rltlab.bench.paired --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --pair W4/W3 --modes graph --loops 4 --out $OUT/paired_w4_w3.json > $OUT/paired_w4_w3.log 2>&1
echo "paired W4/W3 rc $?"; grep "end to end\|Error\|error" $OUT/paired_w4_w3.log | tail -4 | cut -c1-1500
