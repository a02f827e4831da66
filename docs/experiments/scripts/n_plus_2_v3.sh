#!/bin/bash
# Issue 16 deliverable 1 on model v3: N+2 lookahead exit in real generation, CPU, fp32, 1 thread.
# As run on 2026-12-01 in the repository root with the worktree's venv (torch 2.13.0+cpu, Python
# 3.11.7; a 2-core machine shared with other jobs); wall times in the comments. Outputs under
# /tmp/np3 (traces, checkpoints, results.json: not committed). The committed JSON files are the
# pareto.py outputs (analysis + the merged raw results + training metrics and checkpoint
# manifests + these commands); see docs/experiments/n_plus_2.md.
set -e
D=docs/experiments/data
F=docs/experiments/figures
# 1. teacher-mode traces: 512 training-split problems (k-hop and word problems in turn) + 48
#    text prompts, 8,300 decode tokens (4 min 02 s)
DATA='python -m rltlab.exit_predictor.data --out /tmp/np3/traces --arith 512 --text 48 --threads 1'
# 2. predictors (14 s each): after round 1 -> exit at 3 (N+2), before round 1 -> exit at 2
TRAIN1='python -m rltlab.exit_predictor.train --traces /tmp/np3/traces --out /tmp/np3/pred_mlp --rounds 1 --k 2 --model mlp --target-precision 0.99 --threads 1'
TRAIN0='python -m rltlab.exit_predictor.train --traces /tmp/np3/traces --out /tmp/np3/pred0_mlp --rounds 0 --k 2 --model mlp --target-precision 0.99 --threads 1'
# 3. real generation on problems 0-199 of the mixed held-out set (100 k-hop + 100 word problems):
#    the main sweep, 47 settings (18 min 51 s)
EVAL1='python -m rltlab.exit_predictor.evaluate --predictor n_plus_2=/tmp/np3/pred_mlp/n1 --predictor n0_n_plus_2=/tmp/np3/pred0_mlp/n0 --predictor n0_then_n1=/tmp/np3/pred0_mlp/n0+/tmp/np3/pred_mlp/n1 --out /tmp/np3/eval --problems 200 --text-rows 1 --concurrency --threads 1 --sweeps '\''{"depths": [1, 2, 3, 4], "q_thresholds": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.99], "delayed_thresholds": [], "delta_eps": [], "kl_eps": [], "oracle_min_rounds": [2, 3], "select_only_thresholds": [0.3, 0.5, 0.7, 0.8, 0.9, 0.95], "lookahead_thresholds": {"n_plus_2": [0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995], "n0_n_plus_2": [0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99], "n0_then_n1": [0.9, 0.98]}}'\'''
#    Q-exit thresholds filling the gap around 3.0 rounds, N+2 at low thresholds (4 min 43 s)
EVAL2='python -m rltlab.exit_predictor.evaluate --predictor n_plus_2=/tmp/np3/pred_mlp/n1 --out /tmp/np3/eval_fill --problems 200 --text-rows 1 --concurrency --threads 1 --sweeps '\''{"depths": [4], "q_thresholds": [0.45, 0.55, 0.58, 0.62, 0.65], "delayed_thresholds": [], "delta_eps": [], "kl_eps": [], "lookahead_thresholds": {"n_plus_2": [0.05, 0.1, 0.2]}}'\'''
#    Q-exit 0.51-0.54, the chained predictor's sweep and its then-threshold-0.98 variant (4 min 17 s)
EVAL3='python -m rltlab.exit_predictor.evaluate --predictor n0_then_n1=/tmp/np3/pred0_mlp/n0+/tmp/np3/pred_mlp/n1 --predictor n0_then_n1_t98=/tmp/np3/pred0_mlp/n0+/tmp/np3/pred_mlp/n1 --out /tmp/np3/eval_fill2 --problems 200 --text-rows 1 --concurrency --threads 1 --sweeps '\''{"depths": [4], "q_thresholds": [0.51, 0.52, 0.53, 0.54], "delayed_thresholds": [], "delta_eps": [], "kl_eps": [], "lookahead_thresholds": {"n0_then_n1": [0.7, 0.8], "n0_then_n1_t98": [0.9]}, "lookahead_args": {"n0_then_n1_t98": {"then_threshold": 0.98}}}'\'''
# 4. confirmatory run on problems 200-399 (no question of 0-199 repeated), settings fixed
#    before it ran (8 min 01 s)
EVAL4='python -m rltlab.exit_predictor.evaluate --predictor n_plus_2=/tmp/np3/pred_mlp/n1 --predictor n0_then_n1=/tmp/np3/pred0_mlp/n0+/tmp/np3/pred_mlp/n1 --predictor n0_then_n1_t98=/tmp/np3/pred0_mlp/n0+/tmp/np3/pred_mlp/n1 --out /tmp/np3/eval_confirm --problems 200 --problem-offset 200 --text-rows 1 --concurrency --threads 1 --sweeps '\''{"depths": [1, 4], "q_thresholds": [0.4, 0.45, 0.5, 0.52, 0.54, 0.55, 0.56, 0.58, 0.6, 0.62, 0.65, 0.7], "delayed_thresholds": [], "delta_eps": [], "kl_eps": [], "oracle_min_rounds": [3], "lookahead_thresholds": {"n_plus_2": [0.7, 0.98], "n0_then_n1": [], "n0_then_n1_t98": [0.9]}, "lookahead_args": {"n0_then_n1_t98": {"then_threshold": 0.98}}}'\'''
for c in "$DATA" "$TRAIN1" "$TRAIN0" "$EVAL1" "$EVAL2" "$EVAL3" "$EVAL4"; do eval "$c"; done
# 5. analysis, figures, replay patterns (a few seconds each)
python -m rltlab.exit_predictor.pareto \
  --results /tmp/np3/eval/results.json /tmp/np3/eval_fill/results.json /tmp/np3/eval_fill2/results.json \
  --predictor n_plus_2 --predictor n0_then_n1_t98 --predictor n0_then_n1 --predictor n0_n_plus_2 \
  --out $D/2026-12-01-n_plus_2-v3-pareto.json --figures $F --stem n_plus_2_v3_pareto \
  --hist "fixed depth=4" --hist "oracle oracle" --hist "oracle_floor min=3" --hist "q_exit t=0.55" \
  --hist "n_plus_2 p>=0.7" --hist "n0_then_n1_t98 p>=0.9952" --hist "n0_then_n1 p>=0.9952" \
  --pattern $D/2026-12-01-n_plus_2-v3-pattern-n_plus_2-p0.7.txt --pattern-setting "n_plus_2 p>=0.7" \
  --pattern $D/2026-12-01-n_plus_2-v3-pattern-n0_then_n1-p0.9952.txt --pattern-setting "n0_then_n1 p>=0.9952" \
  --training n_plus_2=/tmp/np3/pred_mlp --training n0_n_plus_2=/tmp/np3/pred0_mlp \
  --command "$DATA" --command "$TRAIN1" --command "$TRAIN0" --command "$EVAL1" --command "$EVAL2" \
  --command "$EVAL3" --command "full script: docs/experiments/scripts/n_plus_2_v3.sh"
python -m rltlab.exit_predictor.pareto --results /tmp/np3/eval_confirm/results.json \
  --predictor n_plus_2 --predictor n0_then_n1_t98 --predictor n0_then_n1 \
  --out $D/2026-12-01-n_plus_2-v3-confirm.json --figures $F --stem n_plus_2_v3_confirm \
  --hist "fixed depth=4" --hist "q_exit t=0.55" --hist "n_plus_2 p>=0.7" --hist "n0_then_n1 p>=0.9952" \
  --training n_plus_2=/tmp/np3/pred_mlp --training n0_n_plus_2=/tmp/np3/pred0_mlp \
  --command "$EVAL4" --command "full script: docs/experiments/scripts/n_plus_2_v3.sh"
rm -f $F/n_plus_2_v3_*.svg    # PNG only (the Pareto SVG is 220 KB)
