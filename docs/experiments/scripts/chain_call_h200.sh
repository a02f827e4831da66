#!/bin/bash
# Issue 17, 2026-12-02 third session, call 2: window chaining on the H200.
# 1. Exactness (embedded model, fp32, Triton, CUDA graphs): chained and unchained windows vs
#    round steps with gather prefill (chain_exactness.py).
# 2. W3 W4 with graph (chaining on, the default) against graph-no-chain, same run.
# 3. Split-K tiles for the one-row GEMV's o and down shapes under PDL (gemv_split_k_h200.py).
# 4. W1 with graph against graph-no-chain, same run.
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 90 python3 docs/experiments/scripts/chain_exactness.py --device cuda > $OUT/exactness.log 2>&1
echo "exactness rc $?"; grep -v '^{' $OUT/exactness.log | tail -8
timeout 270 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W3 W4 --modes graph,graph-no-chain --out $OUT/pairs_W3_W4.json > $OUT/pairs_W3_W4.log 2>&1
echo "bench W3 W4 rc $?"; grep -v '^{' $OUT/pairs_W3_W4.log | tail -12
timeout 100 python3 docs/experiments/scripts/gemv_split_k_h200.py > $OUT/gemv_split_k.log 2>&1
echo "gemv rc $?"; grep -v '^{"device' $OUT/gemv_split_k.log | cut -c1-400
timeout 110 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W1 --modes graph,graph-no-chain --out $OUT/w1.json > $OUT/w1.log 2>&1
echo "bench W1 rc $?"; grep -v '^{' $OUT/w1.log | tail -8
