#!/bin/bash
# For the twentieth session's first device call (H200): which kernels the GPU runs, and how long
# it idles, in target-only decoding and in the tree path (chain K = 4 + lookup 10, adaptive;
# gemv_rows = 64, glue compiled) on 32 x 32, with the prompt steps alone as a reference
# (tree_kernel_profile.py); then 16 x 128.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
for shape in "32 32" "16 128"; do
  set -- $shape
  timeout 200 python3 docs/experiments/scripts/tree_kernel_profile.py --device cuda --lookup 10 \
    --adaptive-lookup --prompts $1 --max-tokens $2 > $OUT/kernels_$1x$2.log 2>&1
  echo "kernels $1 x $2 rc $?"; grep -vE "^W1204|warn|^\{" $OUT/kernels_$1x$2.log | cut -c1-160
done
