#!/bin/bash
# Eighth session, call 4 (H200): chained speculative iterations (EngineConfig.spec_chain = 4)
# against one iteration per program (the default), for the trained drafters, end to end on the
# embedded model v4 at c = 1, T = 0, 5 interleaved repeats (paired); small, to fit the device
# time left.
set -euo pipefail
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
python -m rltlab.bench.spec --preset ouro-1.4b --device cuda --dtype bfloat16 --skip-a \
  --impls engine --prompts 32 --tiny-repeats 5 --temperatures 0 --concurrency 1 \
  --compare-chain 4 | tee "$OUT/spec.txt" | grep -v '^{'
tail -1 "$OUT/spec.txt" > "$OUT/spec.json"
