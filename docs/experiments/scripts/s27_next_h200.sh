#!/bin/bash
# Planned in the twenty-seventh session for the next one's first device call (run as the
# twenty-eighth session's call 1, given an H100: docs/benchmarks/2026-12-05-s28-h200-h100.md):
# PrefillGraphs.run_from_ids, built and CPU-tested but never timed, against the general path
# it replaced, paired in one process (from_ids_ab.py: target only early, target only compiled
# early and the claimed tree config, 11 repeats); then s27_call3_h200.sh's idle timeline and
# the claim's 32 x 32 rows at this code on the same start.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 240 python3 docs/experiments/scripts/from_ids_ab.py --device cuda \
  > $OUT/from_ids_ab.log 2>&1
echo "from_ids_ab rc $?"; grep -v "^W1204\|warn" $OUT/from_ids_ab.log | tail -4 | cut -c1-1500
bash "$(dirname "$0")/s27_call3_h200.sh" | tail -n +3
