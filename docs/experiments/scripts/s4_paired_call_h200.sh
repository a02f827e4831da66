#!/bin/bash
# Issue 17, 2026-12-02 fourth session, call 3: the depth pairs measured paired
# (rltlab.bench.paired: baseline and cheap loops alternating on one engine).
# 1. W4/W3 with graph (chaining) and graph-no-chain, 4 rounds each.
# 2. W7/W6 with graph, 4 rounds.
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 330 python3 -m rltlab.bench.paired --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --pair W4/W3 --modes graph,graph-no-chain --loops 4 --out $OUT/paired_w4_w3.json \
  > $OUT/paired_w4_w3.log 2>&1
echo "paired W4/W3 rc $?"; grep "end to end\|Error\|error" $OUT/paired_w4_w3.log | tail -6
timeout 230 python3 -m rltlab.bench.paired --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --pair W7/W6 --modes graph --loops 4 --out $OUT/paired_w7_w6.json > $OUT/paired_w7_w6.log 2>&1
echo "paired W7/W6 rc $?"; grep "end to end\|Error\|error" $OUT/paired_w7_w6.log | tail -6
