#!/bin/bash
# Issue 17, the next device call (written 2026-12-02, second session, not yet run):
# 1. W3 W4 and W6 W7 with prefill first (the default, graph) against graph-mixed-prefill, each
#    closed loop after a first pass on the same engine (bench.engine's closed_loop_first_pass):
#    the depth pairs' shares of their ideal gains without one-off captures in the timings.
# 2. SDPA backends on the fused prefill's attention shapes (flash vs cuDNN vs efficient).
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
for pair in "W3 W4" "W6 W7"; do
  name=${pair// /_}
  timeout 260 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
    --workload $pair --modes graph,graph-mixed-prefill --out $OUT/pairs_$name.json \
    > $OUT/pairs_$name.log 2>&1
  echo "bench $pair rc $?"; grep -v '^{' $OUT/pairs_$name.log | tail -8
done
timeout 60 python3 docs/experiments/scripts/sdpa_backends_h200.py > $OUT/sdpa.log 2>&1
echo "sdpa rc $?"; grep -v '^{"device' $OUT/sdpa.log | cut -c1-200
