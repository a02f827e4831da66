#!/bin/bash
# Eleventh session, call 5 (H200, a short one: ~280 s of device time left): bucketed prefill
# graphs (rltlab.engine.prefill_graphs, opt-in) against the eager fused prefill on the same
# engine: ms per small prefill step, and the first tokens / log-probs of the same prompts.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 150 python3 docs/experiments/scripts/prefill_graphs_h200.py --graph-tokens 4096 \
  > $OUT/prefill_graphs.log 2>&1
echo "rc $?"; grep -vE "it/s" $OUT/prefill_graphs.log | tail -12 | cut -c1-2500
tail -1 $OUT/prefill_graphs.log > $OUT/prefill_graphs.json
