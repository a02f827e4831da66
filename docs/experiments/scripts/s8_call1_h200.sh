#!/bin/bash
# Eighth session, call 1 (H200): greedy step graphs with the LM head over the exiting rows only
# (padded to an exit bucket, rltlab.engine.greedy_steps) exact against round steps; W7's decode
# phase with and without them (same engine); then W7/W6 paired. Needs 66406cd (step graphs and
# the W7-eager arm, since reverted).
set -euo pipefail
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
python docs/experiments/scripts/chain_exactness.py --device cuda --kinds trace-greedy \
  | tee "$OUT/chain_exactness.txt"
python docs/experiments/scripts/w7_gpu_time_h200.py \
  --sequence W6 W7 W7-eager W6 W7-eager W7 | tee "$OUT/w7_step_graphs.txt"
python -m rltlab.bench.paired --preset ouro-1.4b --device cuda --dtype bfloat16 --pair W7/W6 \
  --modes graph --loops 8 --out "$OUT/paired_w7_w6.json" | tail -3
