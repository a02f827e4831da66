#!/bin/bash
# Issue 16, tenth session: the savings share on the confirmatory half (75.4% with one network).
# (a) seed variance: one network's recall at the 0.99-precision threshold moves by +-4 points
#     from seed to seed, so the round-1 predictor becomes the mean of 4 seeded MLPs (--members 4);
# (b) exits at round 2: a round-0 predictor (downstream label at exit round 2, greedy mode;
#     features embed, prev_stats and prev_hidden, the previous state taken at round 3, where
#     most tokens exit) decides before round 1 whether a token exits at round 2; the tokens it
#     lets continue go to (a) at round 1 (`n0_then_n1`).
# The traces and round-3 labels are those of n_plus_2_v4_downstream.sh (same commands); real
# generation on both halves, the halves in parallel (2 processes, 1 thread each).
# CPU, fp32; work under /tmp/s10 (not committed), pareto JSON under docs/experiments/data/.
set -e
W=/tmp/s10; D=docs/experiments/data; TAG=ensemble-chain
SWEEPS='{"depths": [1, 2, 3, 4], "q_thresholds": [0.3, 0.45, 0.5], "delayed_thresholds": [], "delta_eps": [], "kl_eps": [], "oracle_min_rounds": [2, 3], "lookahead_thresholds": {"n_plus_2": [0.5, 0.7, 0.8, 0.9, 0.95, 0.99], "n0_then_n1": [0.9, 0.95, 0.98, 0.99, 0.995]}}'
[ -f $W/traces/manifest.json ] || \
  python -m rltlab.exit_predictor.data --out $W/traces --arith 2048 --text 192 --threads 1
for r in 3 2; do
  [ -f $W/traces/downstream_r$r.safetensors ] || \
    python -m rltlab.exit_predictor.downstream --traces $W/traces --exit-round $r --threads 1
done
python -m rltlab.exit_predictor.train --traces $W/traces --out $W/pred_ens4 --rounds 1 \
  --k 2 --model mlp --members 4 --label downstream --target-precision 0.99 --threads 1
python -m rltlab.exit_predictor.train --traces $W/traces --out $W/pred0_ens4 --rounds 0 \
  --k 2 --model mlp --members 4 --label downstream --target-precision 0.99 --threads 1 \
  --round0-features embed prev_stats prev_hidden --round0-prev-round 3
for half in 0 200; do
  python -m rltlab.exit_predictor.evaluate --predictor n_plus_2=$W/pred_ens4/n1 \
    --predictor n0_then_n1=$W/pred0_ens4/n0+$W/pred_ens4/n1 \
    --out $W/eval_$half --problems 200 --problem-offset $half --text-rows 1 \
    --concurrency --threads 1 --sweeps "$SWEEPS" > $W/eval_$half.log 2>&1 &
done
wait
for half in 0 200; do
  extra=()
  [ $half = 0 ] && extra=(--pattern $D/2026-12-03-n_plus_2-v4-$TAG-pattern-n_plus_2.txt
                          --pattern $D/2026-12-03-n_plus_2-v4-$TAG-pattern-n0_then_n1.txt)
  python -m rltlab.exit_predictor.pareto --results $W/eval_$half/results.json \
    --predictor n_plus_2 --predictor n0_then_n1 --out $D/2026-12-03-n_plus_2-v4-$TAG-p$half.json \
    --training n_plus_2=$W/pred_ens4 --training n0_then_n1=$W/pred0_ens4 \
    --figures docs/experiments/figures --stem n_plus_2_v4_${TAG//-/_}_p$half "${extra[@]}" \
    --command "full script: docs/experiments/scripts/n_plus_2_v4_ensemble_chain.sh (problem offset $half)"
done
# 5. (added after steps 1-4) the ablation: the ninth session's single network (seed 0,
#    /tmp/s9np/pred_ds from n_plus_2_v4_downstream.sh) at the thresholds the 4-network
#    predictor reached, on both halves; its rows into one JSON.
for half in 0 200; do
  python -m rltlab.exit_predictor.evaluate --predictor n_plus_2=/tmp/s9np/pred_ds/n1 \
    --out $W/single_$half --problems 200 --problem-offset $half --text-rows 1 --concurrency \
    --threads 1 --sweeps '{"depths": [4], "q_thresholds": [], "delayed_thresholds": [], "delta_eps": [], "kl_eps": [], "oracle_min_rounds": [], "lookahead_thresholds": {"n_plus_2": [0.7, 0.75]}}' \
    > $W/single_$half.log 2>&1 &
done
wait
python - <<PY
import json
out = {"command": "docs/experiments/scripts/n_plus_2_v4_ensemble_chain.sh, step 5",
       "predictor": "/tmp/s9np/pred_ds/n1 (one MLP, seed 0, calibrated threshold 0.7874)",
       "halves": {}}
for half in (0, 200):
    r = json.load(open(f"$W/single_{half}/results.json"))
    out["halves"][str(half)] = {"problem_offset": half, "rows": [
        {k: x[k] for k in ("key", "quality", "diff_pp", "diff_se_pp", "mean_rounds",
                           "decode_tokens")} for x in r["arithmetic"]],
        "scores": {k: v for k, v in r["scores"].items() if k.startswith(("n_plus_2", "fixed"))}}
json.dump(out, open("$D/2026-12-03-n_plus_2-v4-single-network-ablation.json", "w"), indent=1)
PY
