#!/bin/bash
# Issue 17, 2026-12-02 sixth session, call 4 (one-row o and gate/up tiles re-tuned in the round).
# 1. Exactness (fp32, embedded model): one-row rounds with the new tiles against the gather path.
# 2. w1_tiles_h200.py --sweep third: the new tiles against the previous ones, four pairs in one
#    process, and a few more o / down variants.
# 3. The W1 figure: bench.engine, mode graph (median of three decode phases).
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
timeout 150 python3 docs/experiments/scripts/one_row_exactness.py --device cuda > $OUT/one_row_exactness.log 2>&1
echo "one-row exactness rc $?"; grep -v '^{' $OUT/one_row_exactness.log | grep -v Warn | tail -6
timeout 200 python3 docs/experiments/scripts/w1_tiles_h200.py --sweep third > $OUT/w1_tiles3.log 2>&1
echo "tiles rc $?"; grep -v '^{' $OUT/w1_tiles3.log | grep -v Warn | tail -16
timeout 110 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W1 --modes graph --out $OUT/w1_graph.json > $OUT/w1_graph.log 2>&1
echo "bench W1 rc $?"
python3 - <<'PY'
import json, os
res = json.load(open(os.environ["OUT"] + "/w1_graph.json"))["workloads"]["W1"]["modes"]["graph"]
print("W1 graph", res["decode"]["decode_tok_s"], res["decode"].get("runs_tok_s"),
      res.get("round", {}).get("gpu_ms_per_round"))
PY
