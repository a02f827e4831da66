#!/bin/bash
# For the thirteenth session's first call (H200): issue 17's items not re-measured since the
# code changed under them: W1 (>= 250 tok/s, last measured in the sixth session), W5 with
# shared groups against the same requests sent independently (>= 1.5x, last measured
# 2026-12-01), and W3's printed ceiling and prefill_pct_of_matmul, on main with bucketed prefill
# graphs on by default. W4/W3 and W7/W6 were measured paired in the twelfth session.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 540 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W1 W5 W3 --modes graph --out $OUT/engine_w1_w5_w3.json > $OUT/engine.log 2>&1
echo "engine rc $?"; grep -vE "it/s|req/s" $OUT/engine.log | tail -14 | cut -c1-1500
