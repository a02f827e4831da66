#!/bin/bash
# Eleventh session, call 4 (H200): call 3 found small prefill steps host-bound (~9 ms for one
# 128-token prompt; cuDNN attention ~0.42 ms of host time per layer call). W7's closed loop
# prefills its second wave in 7 small batches, whose shapes recur loop after loop and so take
# cuDNN after 16 rounds. Arms on one engine, paired by round: the default (cuDNN once a shape
# ran 16 rounds), cuDNN at once (cudnn=0, a long-running engine's steady state), never (off).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 560 python3 docs/experiments/scripts/w7_admission_h200.py --arms W7 W7+cudnn=0 \
  W7+cudnn=off --rounds 5 > $OUT/w7_cudnn.log 2>&1
echo "rc $?"; grep -vE "it/s|round/s" $OUT/w7_cudnn.log | tail -8 | cut -c1-2500
tail -1 $OUT/w7_cudnn.log > $OUT/w7_cudnn.json
