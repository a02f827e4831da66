#!/bin/bash
# Issue 17, 2026-12-02 sixth session, call 9 (greedy windows sample through kernels/greedy.py).
# 1. chain_exactness.py (fp32, embedded model), now with greedy-only kinds (the new path)
#    against round steps (the general sampler).
# 2. W7/W6 paired (rltlab.bench.paired, 4 loops).
# 3. w7_exit_work_bound_h200.py: what the exit work still costs W7's decode phase.
# 4. The W1 figure (bench.engine, graph).
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
timeout 100 python3 docs/experiments/scripts/chain_exactness.py --device cuda > $OUT/chain_exactness.log 2>&1
echo "chain exactness rc $?"; grep -v '^{' $OUT/chain_exactness.log | grep -v Warn | grep fp32
timeout 250 python3 -m rltlab.bench.paired --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --pair W7/W6 --modes graph --loops 4 --out $OUT/paired_w7_w6.json > $OUT/paired.log 2>&1
echo "paired rc $?"; grep -v '^{' $OUT/paired.log | grep -v Warn | tail -12
timeout 90 python3 docs/experiments/scripts/w7_exit_work_bound_h200.py --repeats 1 > $OUT/w7_bound.log 2>&1
echo "bound rc $?"; grep -v Warn $OUT/w7_bound.log | tail -4
timeout 60 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W1 --modes graph --out $OUT/w1_graph.json > $OUT/w1_graph.log 2>&1
echo "bench W1 rc $?"; grep -v Warn $OUT/w1_graph.log | grep "W1 " | head -3
