#!/bin/bash
# For the thirteenth session's third call (H200): call 2 ran W5 with shared-prefix attention
# first on a fresh machine, so its loops also paid every Triton compile (its independent loop,
# which forms no groups, ran 20.1 s against 16.6 s in the second mode). Here: the attention
# and the decode phase alone, warm and alternating (shared_prefix_h200.py); then W5 with W1
# first as warm-up, the plain mode first; then W5 again in a second process (Triton's disk
# cache warm), the shared mode first.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 150 python3 docs/experiments/scripts/shared_prefix_h200.py --preset ouro-1.4b \
  --device cuda --dtype bfloat16 > $OUT/shared_prefix_h200.log 2>&1
echo "shared prefix rc $?"; grep -v "it/s" $OUT/shared_prefix_h200.log | tail -3 | cut -c1-900
tail -1 $OUT/shared_prefix_h200.log > $OUT/shared_prefix_h200.json
timeout 200 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W1 W5 --modes graph-no-shared-prefix,graph --out $OUT/engine_w5_a.json \
  > $OUT/engine_a.log 2>&1
echo "engine a rc $?"; grep -vE "it/s|req/s|^\{|^W" $OUT/engine_a.log | tail -7 | cut -c1-400
timeout 170 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W5 --modes graph,graph-no-shared-prefix --out $OUT/engine_w5_b.json \
  > $OUT/engine_b.log 2>&1
echo "engine b rc $?"; grep -vE "it/s|req/s|^\{|^W" $OUT/engine_b.log | tail -5 | cut -c1-400
