#!/bin/bash
# Tenth session, call 2 (H200): (1) where W7's decode phase went on this machine (call 1: W7/W6
# paired median 63.4% against 73.5-80.5% in the fourth to eighth sessions, W6 unchanged):
# w7_gpu_time's per-phase GPU time in graphs, exit work and host idle, to set beside the
# eighth session's call 1; (2) the tenth session's N+2 operating points on problems 0-199,
# replayed at the Ouro-1.4B shape against fixed depth 4 in the same run: the 4-network
# round-1 predictor at p >= 0.7 and the chained round-0 + round-1 predictors at p >= 0.99,
# c = 1 (64-token prompts, 32 new tokens) and c = 64 decode-heavy (128 / 256). One JSONL file
# and logs (the device returns at most 8 files).
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
nproc; lscpu | grep -E "Model name|MHz" | head -3
timeout 240 python3 docs/experiments/scripts/w7_gpu_time_h200.py > $OUT/w7_gpu_time.log 2>&1
echo "w7_gpu_time rc $?"; grep -E "^W[67] " $OUT/w7_gpu_time.log | cut -c1-400
D=docs/experiments/data
ENS=$(cat $D/2026-12-03-n_plus_2-v4-ensemble-chain-pattern-n_plus_2.txt)
CHAIN=$(cat $D/2026-12-03-n_plus_2-v4-ensemble-chain-pattern-n0_then_n1.txt)
for p in ENS CHAIN; do
  replay_run ${p,,}-c1 --concurrency 1 --pattern "${!p}"
  replay_run ${p,,}-c64-long --concurrency 64 --prompt-len 128 --max-tokens 256 --pattern "${!p}"
done
