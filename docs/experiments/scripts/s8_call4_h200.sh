#!/bin/bash
# Eighth session, call 4 (H200): chained speculative iterations (EngineConfig.spec_chain = 4,
# the engine's default) against 1 and 2 iterations per program, for the trained drafters, end
# to end on the embedded model v4 at c = 1 and 8, T = 0 and 1, 7 interleaved repeats (paired).
set -euo pipefail
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
python -m rltlab.bench.spec --preset ouro-1.4b --device cuda --dtype bfloat16 --skip-a \
  --impls engine --prompts 32 --tiny-repeats 7 --temperatures 0 1 --concurrency 1 8 \
  --compare-chain 1 2 | tee "$OUT/spec.txt" | grep -v '^{'
tail -1 "$OUT/spec.txt" > "$OUT/spec.json"
