#!/bin/bash
# For the twentieth session's second device call (H200): lean rounds (the exit gate only where
# its logits are read, RoPE tables once per token / iteration / prompt step, a one-kernel first
# norm, no hidden_in copies) against the commit before them (de2c0c7, carried as .ab/: git
# archive de2c0c7 rltlab kernels engine_patches), each in its own process on this machine start:
# the paired 32 x 32 bench (target only, target only compiled, chain K = 4 with lookup 10,
# always and adaptive; 9 repeats), then the new code's kernel profile.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
BENCH=(--only "chain K=4" --budgets --gemv-rows 64 --chains 1 --engine-compile on
       --lookup 10 --adaptive-lookup --repeats 9)
tree_bench lean_32 200 "${BENCH[@]}"
(cd .ab && ln -sfn ../kernels rltlab/kernels && ln -sfn ../engine_patches rltlab/engine_patches \
   && ln -sfn ../artifacts artifacts && PYTHONPATH=$PWD tree_bench base_32 200 "${BENCH[@]}")
timeout 150 python3 docs/experiments/scripts/tree_kernel_profile.py --device cuda --lookup 10 \
  --adaptive-lookup > $OUT/kernels_lean_32x32.log 2>&1
echo "kernels rc $?"; grep "^==" $OUT/kernels_lean_32x32.log
