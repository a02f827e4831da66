#!/bin/bash
# As run at 1cbfcce-670cec2, when prefill first was mode graph-prefill-first and graph mixed the
# prefills with decode rows. Since then prefill first is the default (graph), and the old graph is
# graph-mixed-prefill.
# Issue 17: are the slow steps of a W4 closed loop one-off costs? Two timed closed loops per
# engine (closed_loop_steps.py --passes 2), modes graph and graph-prefill-first.
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 165 python3 docs/experiments/scripts/closed_loop_steps.py W4 graph graph-prefill-first \
  --passes 2 --out $OUT/steps_passes_W4.json > $OUT/steps_passes_W4.log 2>&1
echo "steps rc $?"; grep -v '^{' $OUT/steps_passes_W4.log | cut -c1-900
