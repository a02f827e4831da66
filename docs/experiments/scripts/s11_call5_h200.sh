#!/bin/bash
# Eleventh session, call 5 (H200; refused: too little device time was left, so it is the next
# session's first call). Bucketed prefill graphs (rltlab.engine.prefill_graphs, opt-in):
# (1) against the eager fused prefill on one engine: ms per small prefill step, and the first
# tokens / log-probs of the same prompts; (2) W7/W6 paired with and without them (arms on one
# engine, by round), the closed loop that loses 0.22-0.44 s to small prefill steps.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 150 python3 docs/experiments/scripts/prefill_graphs_h200.py --graph-tokens 4096 \
  > $OUT/prefill_graphs.log 2>&1
rc=$?; echo "prefill_graphs rc $rc"; grep -vE "it/s" $OUT/prefill_graphs.log | tail -8 | cut -c1-2500
tail -1 $OUT/prefill_graphs.log > $OUT/prefill_graphs.json
[ $rc -eq 0 ] || { echo "step check failed: the W7 arms are not run"; exit 1; }
timeout 420 python3 docs/experiments/scripts/w7_admission_h200.py --arms W7 W7+graphs=4096 \
  --rounds 6 > $OUT/w7_graphs.log 2>&1
echo "w7 arms rc $?"; grep -vE "it/s|round/s" $OUT/w7_graphs.log | tail -3 | cut -c1-2500
tail -1 $OUT/w7_graphs.log > $OUT/w7_graphs.json
