#!/bin/bash
# Issue 16 deliverable 1 on model v4: N+2 lookahead exit in real generation, CPU, fp32, 1 thread.
# As run on 2026-12-01 in the repository root with the worktree's venv (torch 2.13.0+cpu, Python
# 3.11.7; a 2-core machine shared with other jobs); wall times in the comments. Outputs under
# /tmp/np4 (traces, checkpoints, results.json: not committed). The committed JSON files are the
# pareto.py outputs (analysis + the merged raw results + training metrics and checkpoint
# manifests + these commands); see docs/experiments/n_plus_2.md.
set -e
D=docs/experiments/data
F=docs/experiments/figures
# 1. teacher-mode traces: 512 training-split problems (k-hop and word problems in turn) + 48
#    text prompts, 8,300 decode tokens (1 min 57 s)
DATA='python -m rltlab.exit_predictor.data --out /tmp/np4/traces --arith 512 --text 48 --threads 1'
# 2. predictors (13 s and 10 s): after round 1 -> exit at 3 (N+2), before round 1 -> exit at 2
TRAIN1='python -m rltlab.exit_predictor.train --traces /tmp/np4/traces --out /tmp/np4/pred_mlp --rounds 1 --k 2 --model mlp --target-precision 0.99 --threads 1'
TRAIN0='python -m rltlab.exit_predictor.train --traces /tmp/np4/traces --out /tmp/np4/pred0_mlp --rounds 0 --k 2 --model mlp --target-precision 0.99 --threads 1'
# 3. real generation on problems 0-199 of the mixed held-out set (100 k-hop + 100 word problems):
#    the main sweep, 47 settings (13 min 09 s)
EVAL1='python -m rltlab.exit_predictor.evaluate --predictor n_plus_2=/tmp/np4/pred_mlp/n1 --predictor n0_n_plus_2=/tmp/np4/pred0_mlp/n0 --predictor n0_then_n1=/tmp/np4/pred0_mlp/n0+/tmp/np4/pred_mlp/n1 --out /tmp/np4/eval --problems 200 --text-rows 1 --concurrency --threads 1 --sweeps '\''{"depths": [1, 2, 3, 4], "q_thresholds": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.99], "delayed_thresholds": [], "delta_eps": [], "kl_eps": [], "oracle_min_rounds": [2, 3], "select_only_thresholds": [0.3, 0.5, 0.7, 0.8, 0.9, 0.95], "lookahead_thresholds": {"n_plus_2": [0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995], "n0_n_plus_2": [0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99], "n0_then_n1": [0.9, 0.98]}}'\'''
#    Chosen after EVAL1: Q-exit thresholds filling the gap between t=0.2 (3.045 rounds) and t=0.3
#    (3.431), where the predictors land, and t=0.45; N+2 at the high thresholds 0.998-0.9995
#    (none of EVAL1's was within 0.5 pt of depth 4); the chained predictor at p>=0.95
#    (20 settings, 5 min 45 s)
EVAL2='python -m rltlab.exit_predictor.evaluate --predictor n_plus_2=/tmp/np4/pred_mlp/n1 --predictor n0_then_n1=/tmp/np4/pred0_mlp/n0+/tmp/np4/pred_mlp/n1 --out /tmp/np4/eval_fill --problems 200 --text-rows 1 --concurrency --threads 1 --sweeps '\''{"depths": [4], "q_thresholds": [0.22, 0.24, 0.25, 0.26, 0.27, 0.28, 0.29, 0.31, 0.32, 0.34, 0.36, 0.45], "delayed_thresholds": [], "delta_eps": [], "kl_eps": [], "lookahead_thresholds": {"n_plus_2": [0.998, 0.999, 0.9995], "n0_then_n1": [0.95]}}'\'''
# 4. confirmatory run on problems 200-399 (no question of 0-199 repeated), settings fixed after
#    EVAL2 and before it ran: depths 1-4, Q-exit densely over 0.2-0.5, the oracle and the oracle
#    floored at 3, N+2 at its calibrated threshold and 5 others, the chained predictor at its
#    calibrated threshold and at p>=0.98 (8 min 08 s)
EVAL4='python -m rltlab.exit_predictor.evaluate --predictor n_plus_2=/tmp/np4/pred_mlp/n1 --predictor n0_then_n1=/tmp/np4/pred0_mlp/n0+/tmp/np4/pred_mlp/n1 --out /tmp/np4/eval_confirm --problems 200 --problem-offset 200 --text-rows 1 --concurrency --threads 1 --sweeps '\''{"depths": [1, 2, 3, 4], "q_thresholds": [0.2, 0.22, 0.24, 0.25, 0.26, 0.27, 0.28, 0.29, 0.3, 0.31, 0.32, 0.34, 0.36, 0.4, 0.45, 0.5], "delayed_thresholds": [], "delta_eps": [], "kl_eps": [], "oracle_min_rounds": [3], "lookahead_thresholds": {"n_plus_2": [0.5, 0.9, 0.95, 0.99, 0.999], "n0_then_n1": [0.98]}}'\'''
for c in "$DATA" "$TRAIN1" "$TRAIN0" "$EVAL1" "$EVAL2" "$EVAL4"; do eval "$c"; done
# 5. analysis, figures, replay patterns (a few seconds each)
python -m rltlab.exit_predictor.pareto \
  --results /tmp/np4/eval/results.json /tmp/np4/eval_fill/results.json \
  --predictor n_plus_2 --predictor n0_then_n1 --predictor n0_n_plus_2 \
  --out $D/2026-12-01-n_plus_2-v4-pareto.json --figures $F --stem n_plus_2_v4_pareto \
  --hist "fixed depth=4" --hist "oracle oracle" --hist "oracle_floor min=3" --hist "q_exit t=0.24" \
  --hist "q_exit t=0.31" --hist "n_plus_2 p>=0.7955" --hist "n0_then_n1 p>=0.98" \
  --pattern $D/2026-12-01-n_plus_2-v4-pattern-n_plus_2-p0.7955.txt --pattern-setting "n_plus_2 p>=0.7955" \
  --pattern $D/2026-12-01-n_plus_2-v4-pattern-n0_then_n1-p0.9999.txt --pattern-setting "n0_then_n1 p>=0.9999" \
  --pattern $D/2026-12-01-n_plus_2-v4-pattern-n0_then_n1-p0.98.txt --pattern-setting "n0_then_n1 p>=0.98" \
  --training n_plus_2=/tmp/np4/pred_mlp --training n0_n_plus_2=/tmp/np4/pred0_mlp \
  --command "$DATA" --command "$TRAIN1" --command "$TRAIN0" --command "$EVAL1" --command "$EVAL2" \
  --command "full script: docs/experiments/scripts/n_plus_2_v4.sh"
python -m rltlab.exit_predictor.pareto --results /tmp/np4/eval_confirm/results.json \
  --predictor n_plus_2 --predictor n0_then_n1 \
  --out $D/2026-12-01-n_plus_2-v4-confirm.json --figures $F --stem n_plus_2_v4_confirm \
  --hist "fixed depth=4" --hist "oracle_floor min=3" --hist "q_exit t=0.24" --hist "q_exit t=0.31" \
  --hist "n_plus_2 p>=0.7955" --hist "n0_then_n1 p>=0.98" \
  --training n_plus_2=/tmp/np4/pred_mlp --training n0_n_plus_2=/tmp/np4/pred0_mlp \
  --command "$EVAL4" --command "full script: docs/experiments/scripts/n_plus_2_v4.sh"
rm -f $F/n_plus_2_v4_*.svg    # PNG only (the Pareto SVG is large)
# 6. (added later) the per-problem oracle in `analysis`, recomputed from the raw results each JSON
#    embeds; the v3 files the same way
for f in v4-pareto v4-confirm v3-pareto v3-confirm; do
  python -m rltlab.exit_predictor.pareto --reanalyse $D/2026-12-01-n_plus_2-$f.json \
    --figures $F --stem n_plus_2_$(echo $f | tr - _)
done
rm -f $F/n_plus_2_v*.svg
