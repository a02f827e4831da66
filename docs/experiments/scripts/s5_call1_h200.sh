#!/bin/bash
# Issue 17, 2026-12-02 fifth session, call 1.
# 1. W1 with the L2 prefetch of the next GEMV's weights (kernels/l2_prefetch.py) at 4, 8 and
#    16 MiB per kernel against none, same run, twice in opposite orders (drift).
# 2. One-row exactness with the prefetch on (fp32, against the gather path).
# 3. W6 / W7 decode steps under torch.profiler: per-kernel GPU time per token.
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
timeout 140 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W1 --modes graph,graph-l2-4,graph-l2-8,graph-l2-16 --out $OUT/w1_a.json > $OUT/w1_a.log 2>&1
echo "bench W1 a rc $?"; grep -v '^{\|^W[0-9] ' $OUT/w1_a.log | tail -8
timeout 140 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W1 --modes graph-l2-16,graph-l2-8,graph-l2-4,graph --out $OUT/w1_b.json > $OUT/w1_b.log 2>&1
echo "bench W1 b rc $?"; grep -v '^{\|^W[0-9] ' $OUT/w1_b.log | tail -8
python3 - <<'PY'
import json, os
for run in ("w1_a", "w1_b"):
    modes = json.load(open(f"{os.environ['OUT']}/{run}.json"))["workloads"]["W1"]["modes"]
    for mode, res in modes.items():
        d = res.get("decode", {})
        print(run, mode, d.get("decode_tok_s"), d.get("runs_tok_s"), res.get("round", {}).get("gpu_ms_per_round"))
PY
timeout 100 python3 docs/experiments/scripts/one_row_exactness.py --device cuda > $OUT/one_row_exactness.log 2>&1
echo "one-row exactness rc $?"; grep -v '^{' $OUT/one_row_exactness.log | tail -4
timeout 200 python3 docs/experiments/scripts/w7_step_profile_h200.py --steps 3 > $OUT/w7_profile.log 2>&1
echo "w7 profile rc $?"; grep -v '^{' $OUT/w7_profile.log | grep -v Warn | tail -34
