#!/bin/bash
# Issue 17, 2026-12-02 third session, call 3 (after chaining, cuDNN prefill and the split-K tiles):
# 1. W3 W4 with graph (the default: chaining, cuDNN for recurring prompt shapes) against
#    graph-flash-prefill (FlashAttention-2 only), same run.
# 2. W6 W7 with graph against graph-no-chain, same run.
# 3. W1 with graph (split-K down tiles) against graph-no-chain, same run.
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 240 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W3 W4 --modes graph,graph-flash-prefill --out $OUT/pairs_W3_W4.json > $OUT/pairs_W3_W4.log 2>&1
echo "bench W3 W4 rc $?"; grep -v '^{\|^W[0-9] ' $OUT/pairs_W3_W4.log | tail -12
timeout 200 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W6 W7 --modes graph,graph-no-chain --out $OUT/pairs_W6_W7.json > $OUT/pairs_W6_W7.log 2>&1
echo "bench W6 W7 rc $?"; grep -v '^{\|^W[0-9] ' $OUT/pairs_W6_W7.log | tail -12
timeout 100 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W1 --modes graph,graph-no-chain --out $OUT/w1.json > $OUT/w1.log 2>&1
echo "bench W1 rc $?"; grep -v '^{\|^W[0-9] ' $OUT/w1.log | tail -6
