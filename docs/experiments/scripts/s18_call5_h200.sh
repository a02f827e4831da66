#!/bin/bash
# For the eighteenth session's fifth device call (H200): a request's first tree iteration with
# the heads' drafts from token 0's state against without (first_drafts_ab.py, paired in one
# process, target only beside): chain K = 4 + lookup 8 on 32 x 32 (15 repeats), chain K = 4
# alone on 32 x 32 (15 repeats).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
for lookup in 8 0; do
  timeout 140 python3 docs/experiments/scripts/first_drafts_ab.py --device cuda --lookup $lookup \
    --repeats 15 > $OUT/first_drafts_lookup$lookup.log 2>&1
  echo "lookup $lookup rc $?"; grep -E "^(identical|tau|speedup|first)" $OUT/first_drafts_lookup$lookup.log
done
