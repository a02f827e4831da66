#!/bin/bash
# Ran at d536c26; the fold (EngineConfig.fold_norms, bench mode graph-unfolded-norms) was reverted in ab40ce0 as slower.
# Issue 17, 2026-12-02 sixth session, call 1 (sandwich norms folded into the GEMV before them).
# 1. Exactness (fp32, embedded model): one-row rounds with folded norms (the default), unfolded,
#    and the earlier configurations, against the gather path.
# 2. W1 default (folded) against graph-unfolded-norms, same run, twice in opposite orders.
# 3. The one-row LM head: cuBLAS against the Triton GEMV at a few tiles.
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
timeout 150 python3 docs/experiments/scripts/one_row_exactness.py --device cuda > $OUT/one_row_exactness.log 2>&1
echo "one-row exactness rc $?"; grep -v '^{' $OUT/one_row_exactness.log | grep -v Warn | tail -6
for order in graph,graph-unfolded-norms graph-unfolded-norms,graph; do
  timeout 110 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
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
timeout 90 python3 docs/experiments/scripts/lm_head_gemv_h200.py > $OUT/lm_head.log 2>&1
echo "lm head rc $?"; grep -v '^{' $OUT/lm_head.log | grep -v Warn | tail -10
