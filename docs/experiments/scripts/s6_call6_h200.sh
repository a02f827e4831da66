#!/bin/bash
# Issue 17, 2026-12-02 sixth session, call 6: the L2 prefetch budget re-swept on the re-tuned
# one-row tiles (4 MiB per kernel was the best of 1-16 on the previous ones), default first and
# last, in one process (bench.engine: one engine per mode, median of three decode phases each).
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
timeout 400 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W1 --modes graph,graph-l2-2,graph-l2-6,graph-l2-8,graph-no-l2-prefetch,graph-l2-4 \
  --out $OUT/w1_prefetch.json > $OUT/w1_prefetch.log 2>&1
echo "bench W1 rc $?"
python3 - <<'PY'
import json, os
for mode, res in json.load(open(os.environ["OUT"] + "/w1_prefetch.json"))["workloads"]["W1"]["modes"].items():
    d = res.get("decode", {})
    print(mode, d.get("decode_tok_s"), d.get("runs_tok_s"), res.get("round", {}).get("gpu_ms_per_round"))
PY
