#!/bin/bash
# Issue 17, 2026-12-02 fifth session, call 2.
# 1. W1: L2 prefetch budgets 1-6 MiB per kernel against none, same run (call 1: 4 MiB best of
#    4 / 8 / 16).
# 2. W7 with round windows of 8, 16 (default) and 32 round steps, and W6 (default) beside them:
#    is W7's decode phase held back by per-window host work?
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
timeout 170 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W1 --modes graph,graph-l2-1,graph-l2-2,graph-l2-3,graph-l2-4,graph-l2-6 \
  --out $OUT/w1.json > $OUT/w1.log 2>&1
echo "bench W1 rc $?"
timeout 330 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W7 --modes graph-rw8,graph,graph-rw32 --out $OUT/w7.json > $OUT/w7.log 2>&1
echo "bench W7 rc $?"
timeout 100 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W6 --modes graph --out $OUT/w6.json > $OUT/w6.log 2>&1
echo "bench W6 rc $?"
python3 - <<'PY'
import json, os
for run in ("w1", "w7", "w6"):
    try:
        workloads = json.load(open(f"{os.environ['OUT']}/{run}.json"))["workloads"]
    except (OSError, ValueError) as err:
        print(run, "no JSON:", err); continue
    for name, entry in workloads.items():
        for mode, res in entry["modes"].items():
            d, loop = res.get("decode", {}), res.get("closed_loop", {})
            print(name, mode, "decode", d.get("decode_tok_s"), d.get("runs_tok_s"), "round ms",
                  res.get("round", {}).get("gpu_ms_per_round"), "e2e", loop.get("tok_s"),
                  "first pass", res.get("closed_loop_first_pass", {}).get("tok_s"),
                  "windows", res.get("round_windows") or res.get("token_windows"))
PY
