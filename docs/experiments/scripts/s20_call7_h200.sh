#!/bin/bash
# For the twentieth session's seventh device call (H200): the 9..16-row tier of few-row tiles
# (q/k/v with RoPE (2, 128, 4, 2), down (1, 256, 4, 2), from s20_call5's 16-row trials) against
# the 2..8-row tier alone, paired in one process (tiles_ab.py --tiers 16): 32 x 32 with chain
# K = 4 + lookup 10 adaptive (15 repeats); then every tier against none on 16 x 128, lookup 16.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
timeout 240 python3 docs/experiments/scripts/tiles_ab.py --device cuda --lookup 10 \
  --adaptive-lookup --repeats 15 --tiers 16 > $OUT/tiles_ab16_32x32.log 2>&1
echo "tiles_ab --tiers 16, 32 x 32 rc $?"
grep -vE "^W1204|warn|^\{|^ *$" $OUT/tiles_ab16_32x32.log | cut -c1-250
timeout 200 python3 docs/experiments/scripts/tiles_ab.py --device cuda --prompts 16 \
  --max-tokens 128 --lookup 16 --adaptive-lookup --repeats 5 > $OUT/tiles_ab_16x128.log 2>&1
echo "tiles_ab, 16 x 128 rc $?"
grep -vE "^W1204|warn|^\{|^ *$" $OUT/tiles_ab_16x128.log | cut -c1-250
