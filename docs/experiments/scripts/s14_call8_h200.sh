#!/bin/bash
# For the fourteenth session's sixth device call (H200): does s14_call4's set of tree decoders
# (two of them torch.compile'd) lose acceptance on the GPU without the engine or the bench?
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 200 python3 docs/experiments/scripts/tree_spec_two_compiled.py > $OUT/two_compiled.log 2>&1
echo "rc $?"; grep -vE "^W1203|warn|^ *$" $OUT/two_compiled.log | tail -6 | cut -c1-400
