#!/bin/bash
# Issue 17, 2026-12-02 fifth session, call 3 (L2 prefetch on by default, 4 MiB per kernel).
# 1. W1 default against graph-no-l2-prefetch, same run, twice in opposite orders.
# 2. Exactness (fp32, embedded model): one-row rounds with the prefetch on, off and at 8 MiB
#    against the gather path; chained windows against unchained and round steps.
# 3. W7/W6 paired again (rltlab.bench.paired, 4 rounds): one more estimate of the pair's share.
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
for order in graph,graph-no-l2-prefetch graph-no-l2-prefetch,graph; do
  timeout 100 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
    --workload W1 --modes $order --out $OUT/w1_${order%%,*}_first.json > $OUT/w1_${order%%,*}_first.log 2>&1
  echo "bench W1 $order rc $?"
done
python3 - <<'PY'
import json, os, glob
for f in sorted(glob.glob(os.environ["OUT"] + "/w1_*.json")):
    for mode, res in json.load(open(f))["workloads"]["W1"]["modes"].items():
        d = res.get("decode", {})
        print(os.path.basename(f), mode, d.get("decode_tok_s"), d.get("runs_tok_s"),
              res.get("round", {}).get("gpu_ms_per_round"))
PY
timeout 120 python3 docs/experiments/scripts/one_row_exactness.py --device cuda > $OUT/one_row_exactness.log 2>&1
echo "one-row exactness rc $?"; grep -v '^{' $OUT/one_row_exactness.log | grep -v Warn | tail -5
timeout 80 python3 docs/experiments/scripts/chain_exactness.py --device cuda > $OUT/chain_exactness.log 2>&1
echo "chain exactness rc $?"; grep -v '^{' $OUT/chain_exactness.log | grep -v Warn | tail -6
timeout 300 python3 -m rltlab.bench.paired --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --pair W7/W6 --modes graph --loops 4 --out $OUT/paired_w7_w6.json > $OUT/paired.log 2>&1
echo "paired rc $?"; grep -v '^{' $OUT/paired.log | grep -v Warn | tail -12
