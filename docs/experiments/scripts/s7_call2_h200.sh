#!/bin/bash
# Seventh session, call 2 (H200): does a closed loop leave W7's decode phase slower (graphs,
# exit work or host idle)? Decode phases before and after closed loops, on one engine.
set -euo pipefail
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
python docs/experiments/scripts/w7_gpu_time_h200.py \
  --sequence W6 W7 loop:W7 W7 W6 loop:W7 loop:W7 W7 loop:W6 W6 W7 | tee "$OUT/w7_after_loops.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
