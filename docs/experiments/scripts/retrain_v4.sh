#!/bin/bash
# Model v4 (issue 15): Stage I with a stronger depth prior (pi_r ~ 5^(r-1)); everything else as v3.
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.used --format=csv
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 545 python3 -m rltlab.pretrain --out-dir .device_out/v4 --data-dir .device_out/v4data \
  --unseen-code-dir tests/data/unseen_code --data-workers 16 --steps 0 --time-budget-s 500 \
  --compile layer --log-every 100 --eval-every 250 --save-every 100000 --final-eval false \
  --device cuda --depth-prior 5 > $OUT/train.log 2>&1
echo "pretrain rc $?"
grep -E '"step": [0-9]+00,|auto steps|heldout' $OUT/train.log | tail -4
tar -C .device_out -czf $OUT/v4.tgz --exclude train_state v4 && ls -la $OUT
timeout 40 python3 - <<'PY' > $OUT/quick_eval.txt 2>&1
import torch
from rltlab.model.checkpoint import load_model_and_tokenizer
from rltlab.pretrain import evaluate as E
m, t = load_model_and_tokenizer(".device_out/v4", dtype=torch.float32, device="cuda")
print(E.format_table(E.evaluate_rounds(m, t, ".device_out/v4", max_problems=200)))
PY
cat $OUT/quick_eval.txt
