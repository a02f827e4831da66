#!/bin/bash
# Issue 17, 2026-12-02 fourth session, call 2: the one-row round's fusions (3d086d0 RoPE + K/V
# write in the q/k/v GEMV; 598fdec split merge in the decode attention's last split).
# 1. One-row exactness: fused, each fusion off, both off, against the gather path (fp32).
# 2. Chain exactness (8 rows: split attention with the fused merge).
# 3. W1 with both fusions against each one off, and against graph-no-chain, same run.
# 4. W6 W7 with graph against graph-no-chain, same run.
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 150 python3 docs/experiments/scripts/one_row_exactness.py --device cuda > $OUT/one_row_exactness.log 2>&1
echo "one-row exactness rc $?"; grep -v '^{' $OUT/one_row_exactness.log | tail -6
timeout 60 python3 docs/experiments/scripts/chain_exactness.py --device cuda > $OUT/exactness.log 2>&1
echo "chain exactness rc $?"; grep -v '^{' $OUT/exactness.log | tail -6
timeout 150 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W1 --modes graph,graph-unfused-rope,graph-unfused-merge,graph-no-chain \
  --out $OUT/w1.json > $OUT/w1.log 2>&1
echo "bench W1 rc $?"; grep -v '^{\|^W[0-9] ' $OUT/w1.log | tail -12
timeout 200 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W6 W7 --modes graph,graph-no-chain --out $OUT/w6_w7.json > $OUT/w6_w7.log 2>&1
echo "bench W6 W7 rc $?"; grep -v '^{\|^W[0-9] ' $OUT/w6_w7.log | tail -8
