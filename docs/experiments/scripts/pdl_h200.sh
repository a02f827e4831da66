#!/bin/bash
# Issue 17, device call: programmatic dependent launch for one-row rounds (rltlab/kernels/pdl.py)
# and the closed-loop workloads with token and round windows, after the bench's KV-cache leak fix.
# 1. Exactness on the embedded model (fp32, Triton kernels, CUDA graphs, one row at a time so
#    every decode round takes the PDL path): PDL vs no PDL vs round steps; tokens, exit depths
#    and log-probs must be identical.
# 2. W1: graph (PDL + token windows) vs graph-no-pdl vs graph-one-token, same run.
# 3. W3 W4 W6 W7 graph (the depth pairs in one run), then W3 W6 graph-one-token (baselines).
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 150 python3 - <<'PY'
import random, torch
from rltlab.engine import LLM, SamplingParams
from rltlab.model.checkpoint import load_model_and_tokenizer
model, tok = load_model_and_tokenizer("artifacts/ouro-tiny", dtype=torch.float32)
rng = random.Random(0)
prompts = [[0] + [rng.randrange(1, 1000) for _ in range(rng.randrange(8, 300))] for _ in range(12)]
policies = [("fixed", {"depth": 4}), ("fixed", {"depth": 2}),
            ("trace", {"depths": [4] + [rng.choice([1, 2, 3, 4]) for _ in range(40)]})]
params = [SamplingParams(temperature=(0.0, 1.0)[i % 2], seed=i, max_tokens=rng.randrange(16, 40),
                         ignore_eos=True, logprobs=0, exit_policy=policies[i % 3][0],
                         exit_policy_args=policies[i % 3][1]) for i in range(12)]
outs, engaged = {}, {}
for name, kw in (("rounds", dict(fused_tokens=False, pdl=False)), ("no_pdl", dict(pdl=False)),
                 ("pdl", {})):
    llm = LLM(model, device="cuda", dtype=torch.float32, decode_path="static", max_num_seqs=1, **kw)
    engaged[name] = llm.llm_engine.runner.static.pdl
    outs[name] = [o.outputs[0] for o in llm.generate(prompts, params)]
for other in ("no_pdl", "rounds"):
    pairs = list(zip(outs["pdl"], outs[other]))
    same = sum(a.token_ids == b.token_ids and a.exit_depths == b.exit_depths for a, b in pairs)
    bitwise = sum(a.logprobs == b.logprobs for a, b in pairs)
    diff = max(abs(x - y) for a, b in pairs if a.token_ids == b.token_ids
               for x, y in zip(a.logprobs, b.logprobs))
    print(f"cuda fp32 one row, PDL ({engaged['pdl']}) vs {other} ({engaged[other]}): identical "
          f"tokens and depths {same}/12, bit-identical log-probs {bitwise}/12, max |diff| {diff:.2e}")
PY
timeout 110 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W1 --modes graph,graph-no-pdl,graph-one-token --out $OUT/w1.json > $OUT/w1.log 2>&1
echo "W1 bench rc $?"; grep -v '^{' $OUT/w1.log | tail -5
timeout 290 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W3 W4 W6 W7 --modes graph --out $OUT/closed.json > $OUT/closed.log 2>&1
echo "closed-loop bench rc $?"; grep -v '^{' $OUT/closed.log | tail -7
python3 -c "import json; r=json.load(open('$OUT/closed.json')); print(json.dumps(r.get('depth_pairs')))"
timeout 150 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W3 W6 --modes graph-one-token --out $OUT/one_token.json > $OUT/one_token.log 2>&1
echo "one-token bench rc $?"; grep -v '^{' $OUT/one_token.log | tail -4
