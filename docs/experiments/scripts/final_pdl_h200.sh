#!/bin/bash
# Issue 17, last device call of 2026-12-02: the code as it lands (PDL with the default one-row
# tiles, fresh-key prefill, token and round windows): W1 graph vs graph-no-pdl, then
# W3 W4 W6 W7 graph with the depth pairs computed in the same run.
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 90 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W1 --modes graph,graph-no-pdl --out $OUT/w1.json > $OUT/w1.log 2>&1
echo "W1 bench rc $?"; grep -v '^{' $OUT/w1.log | tail -4
timeout 230 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W3 W4 W6 W7 --modes graph --out $OUT/closed.json > $OUT/closed.log 2>&1
echo "closed-loop bench rc $?"; grep -v '^{' $OUT/closed.log | tail -9
