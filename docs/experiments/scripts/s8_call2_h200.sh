#!/bin/bash
# Eighth session, call 2 (H200): adaptive K for the trained loop-aware drafters (issue 16,
# "Adaptive K, if it helps"), against fixed K = 4 and K = 8, end to end on the embedded model v4
# at c = 1 and 8, T = 0 and 1, configs interleaved over 7 repeats (paired).
set -euo pipefail
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
python -m rltlab.bench.spec --preset ouro-1.4b --device cuda --dtype bfloat16 --skip-a \
  --impls engine --prompts 32 --tiny-repeats 7 --temperatures 0 1 --concurrency 1 8 \
  --extra-k 8 --adaptive-k 4 8 | tee "$OUT/spec.txt" | grep -v '^{'
tail -1 "$OUT/spec.txt" > "$OUT/spec.json"
