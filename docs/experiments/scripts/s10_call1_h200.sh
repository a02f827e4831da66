#!/bin/bash
# Tenth session, call 1 (H200): (1) the c = 64, 32-token replays of the ninth session again,
# now that depth_gain warms up on one untimed pass of the workload itself (is fixed depth 4's
# TTFT of 448 ms, against 59 ms for the replay, a warm-up artefact?); (2) W7/W6 paired, 10
# rounds, on today's code, to pool with the sixth to eighth sessions' rounds. Results in one
# JSONL file and logs (the device returns at most 8 files).
set -uo pipefail
REPLAY_TIMEOUT=120
source "$(dirname "$0")/h200_common.sh"
D=docs/experiments/data
ARGMAX=$(cat $D/2026-12-01-n_plus_2-v4-pattern-n_plus_2-p0.7955.txt)
DOWNSTREAM=$(cat $D/2026-12-03-n_plus_2-v4-downstream-pattern-p0.7874.txt)
for p in DOWNSTREAM ARGMAX; do
  replay_run ${p,,}-c64 --concurrency 64 --pattern "${!p}"
done
timeout 400 python3 -m rltlab.bench.paired --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --pair W7/W6 --modes graph --loops 10 --out "$OUT/paired_w7_w6.json" > $OUT/paired.log 2>&1
echo "paired rc $?"; tail -4 $OUT/paired.log
