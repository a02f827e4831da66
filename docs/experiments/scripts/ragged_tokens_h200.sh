#!/bin/bash
# Issue 17: whole-token steps at mixed host-fixed depths. CUDA exactness check on the embedded
# model (fp32, Triton kernels + CUDA graphs), then the depth pairs W4/W3 and W7/W6.
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD
python3 - <<'PY'
import os, random, torch
DEVICE = os.environ.get('DEVICE', 'cuda')
from rltlab.engine import LLM, SamplingParams
from rltlab.model.checkpoint import load_model_and_tokenizer
model, tok = load_model_and_tokenizer("artifacts/ouro-tiny", dtype=torch.float32)
rng = random.Random(0)
prompts = [[0] + [rng.randrange(1, 1000) for _ in range(rng.randrange(8, 40))] for _ in range(24)]
params = [SamplingParams(temperature=(0.0, 1.0)[i % 2], seed=i, max_tokens=40, ignore_eos=True,
                         logprobs=0, exit_policy="trace",
                         exit_policy_args={"depths": [4] + [rng.choice([1, 2, 3, 4]) for _ in range(40)]})
          for i in range(24)]
outs = {}
for fused in (False, True):
    llm = LLM(model, device=DEVICE, dtype=torch.float32, decode_path="static", fused_tokens=fused,
              max_num_seqs=16)
    calls = []
    run_token = llm.llm_engine.runner.run_token
    llm.llm_engine.runner.run_token = lambda s, d: calls.append(d) or run_token(s, d)
    outs[fused] = llm.generate(prompts, params)
    print("fused", fused, "whole-token steps", len(calls),
          "mixed", sum(isinstance(d, list) for d in calls))
same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs[False], outs[True]))
print(f"CUDA ragged whole tokens vs round steps: identical tokens {same}/24")
PY
timeout 420 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W3 W4 W6 W7 --modes graph --out $OUT/engine.json > $OUT/engine.log 2>&1
echo "bench rc $?"; grep -v '^{' $OUT/engine.log | tail -60
