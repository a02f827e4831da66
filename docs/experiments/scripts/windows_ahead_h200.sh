#!/bin/bash
# Issue 17, next device call: token windows (rltlab/engine/token_window.py: several whole tokens
# per host round trip at one depth) and round windows planned ahead (round_window.py).
# 1. Exactness on the embedded model (fp32, Triton kernels, CUDA graphs): the default engine vs
#    the round-per-step engine with gather-path prefill, fixed-depth and replayed rows.
# 2. Engine bench: W1 W3 W6 with token windows (graph) and without (graph-one-token); W4 W7 with
#    round windows (graph; the plan-ahead share is in each mode's `round_windows`).
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 120 python3 - <<'PY'
import random, torch
from rltlab.engine import LLM, SamplingParams
from rltlab.model.checkpoint import load_model_and_tokenizer
device = "cuda" if torch.cuda.is_available() else "cpu"
model, tok = load_model_and_tokenizer("artifacts/ouro-tiny", dtype=torch.float32)
rng = random.Random(0)
prompts = [[0] + [rng.randrange(1, 1000) for _ in range(rng.randrange(8, 300))] for _ in range(24)]
traced = [SamplingParams(temperature=(0.0, 1.0)[i % 2], seed=i, max_tokens=rng.randrange(16, 40),
                         ignore_eos=True, logprobs=(0, None)[i % 4 == 3], exit_policy="trace",
                         exit_policy_args={"depths": [4] + [rng.choice([1, 2, 3, 4]) for _ in range(40)]})
          for i in range(24)]
fixed = [SamplingParams(temperature=(0.0, 1.0)[i % 2], seed=i, max_tokens=rng.randrange(16, 40),
                        ignore_eos=True, logprobs=(0, None)[i % 4 == 3], exit_policy="fixed",
                        exit_policy_args={"depth": 3}) for i in range(24)]
for label, params in (("replayed depths (round windows)", traced), ("depth 3 (token windows)", fixed)):
    outs, stats = {}, None
    for name, kw in (("rounds", dict(fused_tokens=False, fused_prefill=False)), ("default", {})):
        llm = LLM(model, device=device, dtype=torch.float32, decode_path="static", max_num_seqs=8,
                  prefill_chunk=96, max_num_batched_tokens=512, **kw)
        outs[name] = llm.generate(prompts, params)
        if name == "default" and llm.llm_engine._round_window is not None:
            stats = llm.llm_engine._round_window.stats
    pairs = [(a.outputs[0], b.outputs[0]) for a, b in zip(outs["rounds"], outs["default"])]
    same = sum(a.token_ids == b.token_ids and a.exit_depths == b.exit_depths for a, b in pairs)
    diff = max((abs(x - y) for a, b in pairs if a.token_ids == b.token_ids and a.logprobs
                for x, y in zip(a.logprobs, b.logprobs)), default=0.0)
    print(f"{device} fp32 {label}: default vs round steps + gather prefill: identical tokens and "
          f"depths {same}/24, max |logprob diff| {diff:.2e}; round windows {stats}")
PY
timeout 200 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W1 W3 W6 --modes graph,graph-one-token --out $OUT/tokens.json > $OUT/tokens.log 2>&1
echo "token-window bench rc $?"; grep -v '^{' $OUT/tokens.log | tail -14
timeout 200 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W4 W7 --modes graph --out $OUT/rounds.json > $OUT/rounds.log 2>&1
echo "round-window bench rc $?"; grep -v '^{' $OUT/rounds.log | tail -8
