#!/bin/bash
# For the thirteenth session's fifth call (H200): W5 on main (shared-prefix attention on) with
# the bench's new untimed first pass of both loops (one-off compiles and captures out of the
# timings, as every other workload has) and 4 paired rounds, alternating order: group_speedup
# as median, mean and SE of the rounds. Calls 1-4 gave 1.04-1.53x from single loops.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 330 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W5 --modes graph --w5-rounds 4 --out $OUT/engine_w5_paired.json \
  > $OUT/engine.log 2>&1
echo "engine rc $?"; grep -E "^  W5" $OUT/engine.log | cut -c1-400
