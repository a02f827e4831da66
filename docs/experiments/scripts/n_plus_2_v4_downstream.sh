#!/bin/bash
# Issue 16: the N+2 predictor with a downstream-aware label. The argmax label judges a token
# by its own round-3 output; under LAST_EXITED its round-3 K/V also feeds every later token.
# Same traces as n_plus_2_v4_data4x.sh (4x data: 2,048 training-split problems + 192 text
# prompts), then counterfactual teacher-forced reruns (rltlab.exit_predictor.downstream,
# greedy mode: exits accumulate left to right, an exit is safe when it changes no later
# output), the round-1 predictor trained on that label, and real generation on both halves of
# the mixed held-out set with the same sweeps plus lower thresholds; pareto.py per half.
# CPU, fp32, 1 thread; work under /tmp/s9np (not committed), pareto JSON under
# docs/experiments/data/. MODE=single (added after the greedy run, the ablation): each exit
# alone, in its own work directory and output files (-single-).
set -e
MODE=${MODE:-greedy}
W=/tmp/s9np; TAG=downstream
[ "$MODE" = greedy ] || { W=/tmp/s9np-$MODE; TAG=downstream-$MODE; }
D=docs/experiments/data
SWEEPS='{"depths": [1, 2, 3, 4], "q_thresholds": [0.3, 0.45, 0.5], "delayed_thresholds": [], "delta_eps": [], "kl_eps": [], "oracle_min_rounds": [2, 3], "lookahead_thresholds": {"n_plus_2": [0.5, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.998, 0.999]}}'
[ -f $W/traces/manifest.json ] || \
  python -m rltlab.exit_predictor.data --out $W/traces --arith 2048 --text 192 --threads 1
[ -f $W/traces/downstream_r3.safetensors ] || \
  python -m rltlab.exit_predictor.downstream --traces $W/traces --mode $MODE --threads 1
python -m rltlab.exit_predictor.train --traces $W/traces --out $W/pred_ds \
  --rounds 1 --k 2 --model mlp --label downstream --target-precision 0.99 --threads 1
for half in 0 200; do
  python -m rltlab.exit_predictor.evaluate --predictor n_plus_2=$W/pred_ds/n1 \
    --out $W/eval_$half --problems 200 --problem-offset $half --text-rows 1 \
    --concurrency --threads 1 --sweeps "$SWEEPS"
  python -m rltlab.exit_predictor.pareto --results $W/eval_$half/results.json \
    --predictor n_plus_2 --out $D/2026-12-03-n_plus_2-v4-$TAG-p$half.json \
    --training n_plus_2=$W/pred_ds \
    --command "full script: MODE=$MODE docs/experiments/scripts/n_plus_2_v4_downstream.sh (problem offset $half)"
done
# 4. (added after steps 1-3, the same analysis) the Pareto figures of both halves and the replay
#    pattern of the calibrated setting on problems 0-199 (for rltlab.bench.depth_gain)
for half in 0 200; do
  extra=()
  [ $half = 0 ] && [ "$MODE" = greedy ] && extra=(
    --pattern $D/2026-12-03-n_plus_2-v4-$TAG-pattern-p0.7874.txt \
    --pattern-setting "n_plus_2 p>=0.7874")
  python -m rltlab.exit_predictor.pareto --results $W/eval_$half/results.json \
    --predictor n_plus_2 --out $D/2026-12-03-n_plus_2-v4-$TAG-p$half.json \
    --training n_plus_2=$W/pred_ds --figures docs/experiments/figures \
    --stem n_plus_2_v4_${TAG//-/_}_p$half "${extra[@]}" \
    --command "full script: MODE=$MODE docs/experiments/scripts/n_plus_2_v4_downstream.sh (problem offset $half)"
done
