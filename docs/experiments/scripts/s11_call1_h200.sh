#!/bin/bash
# Eleventh session, call 1 (H200): W7's closed loop admits its second wave in ~58 separate
# events (each a run of prefill-only steps with every decode row held), W6's in one. Does
# admitting in batches (round_window_admit 8, 32) keep more of W7's depth savings? Arms on one
# engine, paired by round; decode phases before and after the loops (tenth session's question:
# do the loops leave W7's decode phase slower?).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
# (ran at 45b1193 as `--admit 1 8 32`; the same arms are now named as below)
timeout 560 python3 docs/experiments/scripts/w7_admission_h200.py \
  --arms W7 W7+admit=8 W7+admit=32 --rounds 5 \
  > $OUT/w7_admission.log 2>&1
echo "rc $?"; grep -vE "it/s|round/s" $OUT/w7_admission.log | tail -8 | cut -c1-2000
tail -1 $OUT/w7_admission.log > $OUT/w7_admission.json
