#!/bin/bash
# Eighth session, call 3 (H200): the greedy exit work's kernels by exit count (what W7 pays
# per round step), then W7/W6 paired on the shipped code (eager exit work), 10 rounds.
set -euo pipefail
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
python docs/experiments/scripts/w7_exit_kernels_h200.py | tee "$OUT/exit_kernels.txt"
python -m rltlab.bench.paired --preset ouro-1.4b --device cuda --dtype bfloat16 --pair W7/W6 \
  --modes graph --loops 10 --out "$OUT/paired_w7_w6.json" | tail -3
