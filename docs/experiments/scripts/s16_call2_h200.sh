#!/bin/bash
# For the sixteenth session's second device call (H200): s16_call1 found the several-row FMA
# GEMVs slower than cuBLAS inside tree iterations (chain K = 4: 1.03 vs 0.78 ms). The kernels
# now load their tiles straight into the 3-D products' layout. Here: the FMA tiles swept per
# weight shape of the embedded model in fp32 against cuBLAS (rltlab.bench.gemv), then the GPU
# time per tree iteration with gemv_rows 1 and 64 again (default tiles).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
TREES=docs/experiments/data/2026-12-03-lookahead-tree-probe-h200.json
timeout 300 python3 -m rltlab.bench.gemv --config artifacts/ouro-tiny/config.json \
  --dtype float32 --rows 1 5 16 37 --sweep --out $OUT/gemv_sweep.json > $OUT/gemv_sweep.log 2>&1
echo "gemv sweep rc $?"; grep -E "^few|^rows" $OUT/gemv_sweep.log | cut -c1-230
timeout 150 python3 docs/experiments/scripts/tree_graph_timing.py --trees-from $TREES \
  --budgets 8 --chains 1 --gemv-rows 1 64 --device cuda > $OUT/tree_graph_timing.log 2>&1
echo "timing rc $?"; grep -E "^\{\"tree" $OUT/tree_graph_timing.log | cut -c1-220
