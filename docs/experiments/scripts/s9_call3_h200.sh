#!/bin/bash
# Ninth session, call 3 (H200): call 2's c = 64 replays again (both patterns, 64 / 32 and
# 128 / 256), every result into ONE JSONL file and one log (call 2 wrote two files per run and
# the device returns 8 files, so the downstream c = 64 JSON did not come back).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
D=docs/experiments/data
ARGMAX=$(cat $D/2026-12-01-n_plus_2-v4-pattern-n_plus_2-p0.7955.txt)
DOWNSTREAM=$(cat $D/2026-12-03-n_plus_2-v4-downstream-pattern-p0.7874.txt)
for p in DOWNSTREAM ARGMAX; do
  replay_run ${p,,}-c64 --concurrency 64 --pattern "${!p}"
  replay_run ${p,,}-c64-long --concurrency 64 --prompt-len 128 --max-tokens 256 --pattern "${!p}"
done
