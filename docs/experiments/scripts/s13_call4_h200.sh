#!/bin/bash
# For the thirteenth session's fourth call (H200): where a W5-shaped decode step goes (greedy
# against sampled on one engine, then a profile of a sampled generate), then W5 on main twice,
# each in its own process after W1 (the second with Triton's disk cache warm): call 2 and 3
# gave group_speedup from 1.04x to 1.46x depending on the order and the compile state.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 200 python3 docs/experiments/scripts/w5_decode_profile_h200.py --preset ouro-1.4b \
  --device cuda --dtype bfloat16 > $OUT/w5_decode_profile.log 2>&1
echo "profile rc $?"; grep -v "it/s" $OUT/w5_decode_profile.log | tail -20 | cut -c1-160
tail -1 $OUT/w5_decode_profile.log > $OUT/w5_decode_profile.json
for run in 1 2; do
  timeout 160 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
    --workload W1 W5 --modes graph --out $OUT/engine_w5_run$run.json > $OUT/engine_$run.log 2>&1
  echo "engine run $run rc $?"; grep -E "^  W5" $OUT/engine_$run.log | cut -c1-300
done
