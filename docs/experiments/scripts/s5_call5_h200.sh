#!/bin/bash
# Issue 17, 2026-12-02 fifth session, call 5: reads hoisted above the PDL wait (the norms'
# weights, the decode attention's context lengths and planes). One-row exactness first, then W1
# alternating between the kernels of 2f35293 (a copy carried as baseline_kernels, not
# committed) and the hoisted ones, four separate processes. Make the copy before the call:
#   mkdir -p docs/experiments/scripts/baseline_kernels && git archive 2f35293 kernels \
#     | tar -x --strip-components=1 -C docs/experiments/scripts/baseline_kernels
ln -sfn ../engine_patches rltlab/engine_patches; ln -sfn ../kernels rltlab/kernels
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 90 python3 docs/experiments/scripts/one_row_exactness.py --device cuda > $OUT/one_row_exactness.log 2>&1
echo "one-row exactness rc $?"; grep -v '^{' $OUT/one_row_exactness.log | grep -v Warn | tail -4
for run in hoisted-1 baseline-1 hoisted-2 baseline-2; do
  case $run in baseline*) ln -sfn ../docs/experiments/scripts/baseline_kernels rltlab/kernels;;
                 *) ln -sfn ../kernels rltlab/kernels;; esac
  timeout 75 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
    --workload W1 --modes graph --out $OUT/w1_$run.json > $OUT/w1_$run.log 2>&1
  echo "$run rc $? $(readlink rltlab/kernels)"
done
ln -sfn ../kernels rltlab/kernels
python3 - <<'PY'
import json, os
for run in ("hoisted-1", "baseline-1", "hoisted-2", "baseline-2"):
    try:
        res = json.load(open(f"{os.environ['OUT']}/w1_{run}.json"))["workloads"]["W1"]["modes"]["graph"]
        print(run, res["decode"]["decode_tok_s"], res["decode"].get("runs_tok_s"), res["round"]["gpu_ms_per_round"])
    except (OSError, KeyError, ValueError) as err:
        print(run, "no result", err)
PY
