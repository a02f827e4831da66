#!/bin/bash
# For the thirteenth session's second call (H200): W5 fell to 1.189x over independent prompts in
# call 1 (was 1.959x on 2026-12-01, before prefill reached ~70% of the matmul rate): the grouped
# run is bound by decode attention reading each sample's copy of the shared 512-token prompt.
# Shared-prefix decode attention (kernels/shared_prefix.py, EngineConfig.shared_prefix_attention)
# reads it once per group. First its exactness on the embedded model (fp32, on against off),
# then W5 (and W1 / W3, which have no groups: the planning's cost) with it on and off, same run.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 150 python3 docs/experiments/scripts/shared_prefix_exactness.py --device cuda \
  > $OUT/shared_prefix_exactness.log 2>&1
echo "exactness rc $?"; tail -5 $OUT/shared_prefix_exactness.log | cut -c1-600
timeout 400 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W5 W1 W3 --modes graph,graph-no-shared-prefix --out $OUT/engine_shared_prefix.json \
  > $OUT/engine.log 2>&1
echo "engine rc $?"; grep -vE "it/s|req/s|^\{" $OUT/engine.log | tail -12 | cut -c1-700
