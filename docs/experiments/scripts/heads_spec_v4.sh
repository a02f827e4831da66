#!/bin/bash
# Draft heads for model v4, then the loop-aware speculation bench (issue 16 item 2).
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD
t0=$(date +%s)
python3 -m rltlab.draft_heads.selfdistill --device cuda --threads 8 --draft-rounds 1 2 \
  --inner 2048 --arith 8192 --text 12288 --rollout-batch 512 --steps 8000 --batch-size 64 \
  --eval-every 500 --patience 6 > $OUT/heads.log 2>&1
echo "heads rc $? in $(( $(date +%s) - t0 )) s"; tail -3 $OUT/heads.log
tar czf $OUT/heads.tgz artifacts/ouro-tiny/draft_heads
t1=$(date +%s)
timeout 300 python3 -m rltlab.bench.spec --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --impls engine --prompts 32 --tiny-repeats 7 --temperatures 0 1 --concurrency 1 8 > $OUT/spec.log 2>&1
echo "spec rc $? in $(( $(date +%s) - t1 )) s"
tail -1 $OUT/spec.log > $OUT/spec.json; grep -v '^{' $OUT/spec.log | tail -40
