#!/bin/bash
# Ninth session, call 2 (H200): the N+2 predictors' exit patterns on problems 0-199, replayed at
# the Ouro-1.4B shape (random weights, bf16) against fixed depth 4 in the same run, with the
# engine as it is now (round windows: rows at mixed depths step round by round). Patterns: the
# argmax-label predictor at its calibrated threshold (2026-12-01, 3.153 mean rounds) and the
# downstream-label predictor at its calibrated threshold (3.227). c = 1 and c = 64 with the
# earlier runs' 64-token prompts and 32 new tokens, and c = 64 decode-heavy (128 / 256).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
D=docs/experiments/data
ARGMAX=$(cat $D/2026-12-01-n_plus_2-v4-pattern-n_plus_2-p0.7955.txt)
DOWNSTREAM=$(cat $D/2026-12-03-n_plus_2-v4-downstream-pattern-p0.7874.txt)
run() {  # name, args...: one depth_gain run; its log and last-line JSON under $OUT
  local name=$1; shift
  timeout 150 python3 -m rltlab.bench.depth_gain --preset ouro-1.4b --device cuda \
    --dtype bfloat16 "$@" > $OUT/$name.log 2>&1
  echo "$name rc $?: $(grep '^gain' $OUT/$name.log)"
  tail -1 $OUT/$name.log > $OUT/$name.json
}
for p in ARGMAX DOWNSTREAM; do
  run ${p,,}-c1 --concurrency 1 --pattern "${!p}"
  run ${p,,}-c64 --concurrency 64 --pattern "${!p}"
  run ${p,,}-c64-long --concurrency 64 --prompt-len 128 --max-tokens 256 --pattern "${!p}"
done
