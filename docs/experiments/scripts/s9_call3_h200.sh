#!/bin/bash
# Ninth session, call 3 (H200): call 2's c = 64 replays again (both patterns, 64 / 32 and
# 128 / 256), every result into ONE JSONL file and one log (call 2 wrote two files per run and
# the device returns 8 files, so the downstream c = 64 JSON did not come back).
set -uo pipefail
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
D=docs/experiments/data
ARGMAX=$(cat $D/2026-12-01-n_plus_2-v4-pattern-n_plus_2-p0.7955.txt)
DOWNSTREAM=$(cat $D/2026-12-03-n_plus_2-v4-downstream-pattern-p0.7874.txt)
run() {  # name, args...: one depth_gain run, appended to $OUT/replays.{log,jsonl}
  local name=$1; shift
  timeout 150 python3 -m rltlab.bench.depth_gain --preset ouro-1.4b --device cuda \
    --dtype bfloat16 "$@" > /tmp/$name.log 2>&1
  echo "$name rc $?: $(grep '^gain' /tmp/$name.log)"
  { echo "== $name: $*"; cat /tmp/$name.log; } >> $OUT/replays.log
  echo "{\"name\": \"$name\", \"result\": $(tail -1 /tmp/$name.log)}" >> $OUT/replays.jsonl
}
for p in DOWNSTREAM ARGMAX; do
  run ${p,,}-c64 --concurrency 64 --pattern "${!p}"
  run ${p,,}-c64-long --concurrency 64 --prompt-len 128 --max-tokens 256 --pattern "${!p}"
done
