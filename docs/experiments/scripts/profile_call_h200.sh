#!/bin/bash
# Issue 17, 2026-12-02 third session, call 1: where decode steps' time goes before changing them.
# 1. SDPA backends on the fused prefill's attention shapes (flash vs cuDNN vs efficient).
# 2. Decode step profiles (GPU kernels per step, host functions): W1, W3 and W4 under graph
#    (prefill first, token windows for W1/W3, round windows for W4).
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 90 python3 docs/experiments/scripts/sdpa_backends_h200.py > $OUT/sdpa.log 2>&1
echo "sdpa rc $?"; grep -v '^{"device' $OUT/sdpa.log | cut -c1-220
timeout 300 python3 docs/experiments/scripts/closed_loop_profile_h200.py --decode-only \
  --runs W1:graph,W3:graph,W4:graph > $OUT/profile.log 2>&1
echo "profile rc $?"; tail -1 $OUT/profile.log > $OUT/profile.json
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/profile.json"))
for r in d["decode"]:
    print(r["workload"], r["mode"], "wall ms/step", r["wall_ms_per_step"], "tok/step",
          r["tokens_per_step"], "gpu ms/step", r["gpu_kernel_ms_per_step"], "busy", r["gpu_busy_pct"])
    for k in r["top_kernels"]:
        print("   ", k)
    for h in r["host_top"][:8]:
        print("   H", h[:150])
PY
