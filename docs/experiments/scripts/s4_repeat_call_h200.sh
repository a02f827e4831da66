#!/bin/bash
# Issue 17, 2026-12-02 fourth session, call 1: repeat runs of the final code of the third session
# (194ea0c), for the figures that had one run only.
# 1. Chain exactness (embedded model, fp32, Triton, CUDA graphs).
# 2. W1 W3 W4 with graph (chaining) against graph-no-chain, same run.
# 3. W6 W7 with graph against graph-no-chain, same run (W7/W6 was never run on the final code).
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 60 python3 docs/experiments/scripts/chain_exactness.py --device cuda > $OUT/exactness.log 2>&1
echo "exactness rc $?"; grep -v '^{' $OUT/exactness.log | tail -6
timeout 220 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W1 W3 W4 --modes graph,graph-no-chain --out $OUT/w1_w3_w4.json > $OUT/w1_w3_w4.log 2>&1
echo "bench W1 W3 W4 rc $?"; grep -v '^{\|^W[0-9] ' $OUT/w1_w3_w4.log | tail -12
timeout 200 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W6 W7 --modes graph,graph-no-chain --out $OUT/w6_w7.json > $OUT/w6_w7.log 2>&1
echo "bench W6 W7 rc $?"; grep -v '^{\|^W[0-9] ' $OUT/w6_w7.log | tail -8
