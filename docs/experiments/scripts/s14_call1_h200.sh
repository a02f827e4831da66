#!/bin/bash
# For the fourteenth session (H200; prepared in the twelfth as s13_call2, not run yet): eager
# prefill steps of whole prompts of mixed lengths run
# one SDPA launch per distinct length per layer (twelfth session, call 1: 16 prompts of
# 100-128 tokens took 79.7 ms eager, 10.7 ms as a bucketed graph). Padding them within length
# buckets (EngineConfig.pad_prefill_attention, opt-in) against the default and the graphs, per
# step; 64 and 128 prompts are over the graphs' 4096-token bound, so there only eager and
# padded differ.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 300 python3 docs/experiments/scripts/prefill_graphs_h200.py --arms eager padded graphs \
  --sizes 1 4 16 32 64 128 > $OUT/padded_prefill.log 2>&1
echo "padded prefill rc $?"; grep -vE "it/s" $OUT/padded_prefill.log | tail -8 | cut -c1-1500
tail -1 $OUT/padded_prefill.log > $OUT/padded_prefill.json
