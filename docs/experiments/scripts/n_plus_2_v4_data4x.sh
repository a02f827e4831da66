#!/bin/bash
# Issue 16: is the N+2 predictor limited by its training data? The same pipeline as
# n_plus_2_v4.sh with 4x the teacher-mode traces (2,048 training-split problems + 192 text
# prompts instead of 512 + 48), the round-1 predictor only, then real generation on both halves
# of the mixed held-out set (0-199 and 200-399) with depths 1-4, three Q-exit thresholds, the
# oracle family and N+2 at its calibrated threshold and 8 others; pareto.py analyses each half.
# CPU, fp32, 1 thread; outputs under /tmp/np8 (not committed), the two pareto JSON files under
# docs/experiments/data/.
set -e
D=docs/experiments/data
SWEEPS='{"depths": [1, 2, 3, 4], "q_thresholds": [0.3, 0.45, 0.5], "delayed_thresholds": [], "delta_eps": [], "kl_eps": [], "oracle_min_rounds": [2, 3], "lookahead_thresholds": {"n_plus_2": [0.9, 0.95, 0.98, 0.99, 0.995, 0.998, 0.999, 0.9995]}}'
python -m rltlab.exit_predictor.data --out /tmp/np8/traces --arith 2048 --text 192 --threads 1
python -m rltlab.exit_predictor.train --traces /tmp/np8/traces --out /tmp/np8/pred_mlp \
  --rounds 1 --k 2 --model mlp --target-precision 0.99 --threads 1
for half in 0 200; do
  python -m rltlab.exit_predictor.evaluate --predictor n_plus_2=/tmp/np8/pred_mlp/n1 \
    --out /tmp/np8/eval_$half --problems 200 --problem-offset $half --text-rows 1 \
    --concurrency --threads 1 --sweeps "$SWEEPS"
  python -m rltlab.exit_predictor.pareto --results /tmp/np8/eval_$half/results.json \
    --predictor n_plus_2 --out $D/2026-12-03-n_plus_2-v4-data4x-p$half.json \
    --training n_plus_2=/tmp/np8/pred_mlp \
    --command "full script: docs/experiments/scripts/n_plus_2_v4_data4x.sh (problem offset $half)"
done
# 3. (added after steps 1-2) the same traces with the KL label (KL(p_4 || p_3) <= 0.05 nats)
#    instead of argmax agreement, problems 0-199 only
python -m rltlab.exit_predictor.train --traces /tmp/np8/traces --out /tmp/np8/pred_kl \
  --rounds 1 --k 2 --model mlp --label kl --eps 0.05 --target-precision 0.99 --threads 1
python -m rltlab.exit_predictor.evaluate --predictor n_plus_2=/tmp/np8/pred_kl/n1 \
  --out /tmp/np8/eval_kl_0 --problems 200 --problem-offset 0 --text-rows 1 --concurrency \
  --threads 1 --sweeps '{"depths": [4], "q_thresholds": [0.3, 0.45], "delayed_thresholds": [], "delta_eps": [], "kl_eps": [], "oracle_min_rounds": [3], "lookahead_thresholds": {"n_plus_2": [0.5, 0.8, 0.9, 0.95, 0.98, 0.99]}}'
python -m rltlab.exit_predictor.pareto --results /tmp/np8/eval_kl_0/results.json \
  --predictor n_plus_2 --out $D/2026-12-03-n_plus_2-v4-data4x-kl-p0.json \
  --training n_plus_2=/tmp/np8/pred_kl \
  --command "docs/experiments/scripts/n_plus_2_v4_data4x.sh, step 3 (KL label, problems 0-199)"
