#!/bin/bash
# Seventh session, call 1 (H200): where W7's decode phase spends its GPU time against W6's.
# (It ran as `--repeats 2`, the same phases as the default `--sequence W6 W7 W6 W7` now.)
set -euo pipefail
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
git log -1 --format=%H > "$OUT/commit.txt" 2>/dev/null || true
python docs/experiments/scripts/w7_gpu_time_h200.py | tee "$OUT/w7_gpu_time.txt"
