#!/bin/bash
# Ninth session, call 1 (H200): chained speculative iterations (EngineConfig.spec_chain = 4)
# against one iteration per program (the default), for the trained drafters, end to end on the
# embedded model v4 at c = 1, T = 0 and 1, 5 interleaved repeats (paired). The eighth
# session's call 4 (the same at T = 0 only, s8_call4_h200.sh) found no machine.
set -euo pipefail
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
python -m rltlab.bench.spec --preset ouro-1.4b --device cuda --dtype bfloat16 --skip-a \
  --impls engine --prompts 32 --tiny-repeats 5 --temperatures 0 1 --concurrency 1 \
  --compare-chain 4 | tee "$OUT/spec.txt" | grep -v '^{'
tail -1 "$OUT/spec.txt" > "$OUT/spec.json"
