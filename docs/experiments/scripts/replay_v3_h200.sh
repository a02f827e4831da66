#!/bin/bash
# Issue 16/17: the v3 N+2 predictors' exit patterns replayed at the Ouro-1.4B shape vs fixed
# depth 4 (same run each), with whole-token steps (default) and with one step per round.
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD
D=docs/experiments/data
N1=$(cat $D/2026-12-01-n_plus_2-v3-pattern-n_plus_2-p0.7.txt); N0=$(cat $D/2026-12-01-n_plus_2-v3-pattern-n0_then_n1-p0.9.txt)
run() {  # name, args...
  local name=$1; shift
  timeout 100 python3 -m rltlab.bench.depth_gain --preset ouro-1.4b --device cuda --dtype bfloat16 "$@" > $OUT/$name.log 2>&1
  echo "$name rc $?: $(grep '^gain' $OUT/$name.log)"; tail -1 $OUT/$name.log > $OUT/$name.json
}
run n1-c1 --concurrency 1 --pattern "$N1"
run n1-c64 --concurrency 64 --pattern "$N1"
run n1-c64-rounds --concurrency 64 --pattern "$N1" --round-steps
run n0n1-c1 --concurrency 1 --pattern "$N0"
run n0n1-c64 --concurrency 64 --pattern "$N0"
timeout 150 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W7 --modes graph,graph-rounds --out $OUT/w7.json > $OUT/w7.log 2>&1
echo "w7 rc $?"; grep -v '^{' $OUT/w7.log | tail -8
