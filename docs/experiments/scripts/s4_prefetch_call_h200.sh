#!/bin/bash
# Issue 17, 2026-12-02 fourth session, call 4: W1 with two weight tiles loaded before the PDL
# wait against one, and the fused RoPE + K/V write against graph-unfused-rope, same run; and
# the exactness of two tiles against one (prefetch_probe_h200.py).
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 280 python3 docs/experiments/scripts/prefetch_probe_h200.py --device cuda > $OUT/prefetch.log 2>&1
echo "prefetch probe rc $?"; grep -v '^{' $OUT/prefetch.log | grep -v Warning | tail -8
grep '^{' $OUT/prefetch.log | tail -1 > $OUT/prefetch.json
