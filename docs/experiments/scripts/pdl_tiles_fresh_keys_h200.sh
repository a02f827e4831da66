#!/bin/bash
# Issue 17, device call after pdl_h200.sh: one-row GEMV tiles tuned under PDL
# (kernels/small_batch.py "one_row_pdl", from `python -m rltlab.bench.gemv --rows 1 --sweep --pdl`)
# and prefill attention on the chunks' fresh keys (rltlab/engine/fused_prefill.py: no cache
# gather for chunks from position 0).
# 1. Exactness on the embedded model, fp32, Triton kernels, CUDA graphs:
#    a. one row (every round on the PDL path, new tiles): PDL vs no PDL vs round steps;
#    b. 8 rows, 24 requests, prompts of 8-300 tokens in 96-token chunks: default (fresh-key
#       prefill) vs round steps with gather-path prefill.
# 2. W1 graph vs graph-no-pdl; W3 W4 W6 W7 graph (depth pairs in one run); W3 prefill profile.
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 200 python3 - <<'PY'
import random, torch
from rltlab.engine import LLM, SamplingParams
from rltlab.model.checkpoint import load_model_and_tokenizer
model, tok = load_model_and_tokenizer("artifacts/ouro-tiny", dtype=torch.float32)
rng = random.Random(0)
prompts = [[0] + [rng.randrange(1, 1000) for _ in range(rng.randrange(8, 300))] for _ in range(24)]
policies = [("fixed", {"depth": 4}), ("fixed", {"depth": 2}), ("q_exit", {}),
            ("trace", {"depths": [4] + [rng.choice([1, 2, 3, 4]) for _ in range(40)]})]
params = [SamplingParams(temperature=(0.0, 1.0)[i % 2], seed=i, max_tokens=rng.randrange(16, 40),
                         ignore_eos=True, logprobs=0, exit_policy=policies[i % 4][0],
                         exit_policy_args=policies[i % 4][1]) for i in range(24)]

def compare(label, ref, outs):
    pairs = list(zip(outs, ref))
    same = sum(a.token_ids == b.token_ids and a.exit_depths == b.exit_depths for a, b in pairs)
    diff = max(abs(x - y) for a, b in pairs if a.token_ids == b.token_ids
               for x, y in zip(a.logprobs, b.logprobs))
    bitwise = sum(a.logprobs == b.logprobs for a, b in pairs)
    print(f"cuda fp32 {label}: identical tokens and depths {same}/{len(pairs)}, bit-identical "
          f"log-probs {bitwise}/{len(pairs)}, max |logprob diff| {diff:.2e}")

def run(**kw):
    llm = LLM(model, device="cuda", dtype=torch.float32, decode_path="static", **kw)
    return llm, [o.outputs[0] for o in llm.generate(prompts[:kw.get("n", 24)], params)]

one = dict(max_num_seqs=1)
llm, pdl = run(**one)
assert llm.llm_engine.runner.static.pdl
_, no_pdl = run(pdl=False, **one)
_, rounds = run(fused_tokens=False, pdl=False, fused_prefill=False, **one)
compare("one row, PDL vs no PDL", no_pdl, pdl)
compare("one row, PDL vs round steps + gather prefill", rounds, pdl)
eight = dict(max_num_seqs=8, prefill_chunk=96, max_num_batched_tokens=512)
_, fresh = run(**eight)
_, gather = run(fused_tokens=False, fused_prefill=False, **eight)
compare("8 rows, default (fresh-key prefill) vs round steps + gather prefill", gather, fresh)
PY
timeout 100 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W1 --modes graph,graph-no-pdl --out $OUT/w1.json > $OUT/w1.log 2>&1
echo "W1 bench rc $?"; grep -v '^{' $OUT/w1.log | tail -4
timeout 270 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W3 W4 W6 W7 --modes graph --out $OUT/closed.json > $OUT/closed.log 2>&1
echo "closed-loop bench rc $?"; grep -v '^{' $OUT/closed.log | tail -9
timeout 90 python3 docs/experiments/scripts/closed_loop_profile_h200.py --prefill-only \
  > $OUT/prefill_profile.log 2>&1
echo "prefill profile rc $?"; tail -1 $OUT/prefill_profile.log | head -c 1500
