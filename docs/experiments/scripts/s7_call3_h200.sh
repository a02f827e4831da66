#!/bin/bash
# Seventh session, call 3 (H200): greedy round windows with one graph per step
# (rltlab.engine.greedy_steps): exactness against round steps, then W7's decode phase with
# step graphs and with the exit work launched around the round's graph, same engine.
set -euo pipefail
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
python docs/experiments/scripts/chain_exactness.py --device cuda --kinds trace-greedy,trace \
  | tee "$OUT/chain_exactness.txt"
python docs/experiments/scripts/w7_gpu_time_h200.py \
  --sequence W6 W7 W7-eager W6 W7-eager W7 | tee "$OUT/w7_step_graphs.txt"
