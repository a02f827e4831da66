#!/bin/bash
# For the fourteenth session (H200; prepared in the twelfth as s13_call3, not run yet): the closed
# loop with prompts of mixed lengths
# (--prompt-spread 0.5: 64-192 tokens for W6/W7's 128), where eager prefill steps pay one
# attention launch per distinct length and layer. W7/W6 paired, 4 rounds, in the default mode
# and with padded prefill attention (EngineConfig.pad_prefill_attention, mode
# graph-padded-prefill); --out is rewritten after every round.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 540 python3 -m rltlab.bench.paired --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --pair W7/W6 --modes graph,graph-padded-prefill --loops 4 --prompt-spread 0.5 \
  --out $OUT/paired_mixed_lengths.json > $OUT/paired_mixed_lengths.log 2>&1
echo "paired mixed lengths rc $?"
grep "end to end\|Error\|error" $OUT/paired_mixed_lengths.log | tail -4 | cut -c1-1500
