#!/bin/bash
# Issue 17, 2026-12-02 fourth session, call 5: W7 alone, six closed loops on one engine, with the
# GPU's temperature, clocks and power after each (w7_repeat_h200.py).
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=temperature.gpu,clocks.sm,clocks.mem,power.draw,clocks_throttle_reasons.active --format=csv
timeout 200 python3 docs/experiments/scripts/w7_repeat_h200.py --loops 6 > $OUT/w7_repeat.log 2>&1
echo "w7 repeat rc $?"; grep "^W7 loop" $OUT/w7_repeat.log
grep '^{' $OUT/w7_repeat.log | tail -1 > $OUT/w7_repeat.json
