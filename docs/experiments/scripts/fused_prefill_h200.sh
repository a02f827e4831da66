#!/bin/bash
# Issue 17: prefill through the fused layer (rltlab/engine/fused_prefill.py). CUDA exactness
# check on the embedded model (fp32, Triton kernels, CUDA graphs), then the engine bench: W3
# with prefill on the gather path (the baseline) and on the fused path, then the depth pairs.
# Optional: N1 / N0 = exit-pattern files replayed at the 1.4B shape (issue 16); as run on
# 2026-12-01: N1=docs/experiments/data/2026-12-01-n_plus_2-v4-pattern-n_plus_2-p0.7955.txt
# N0=docs/experiments/data/2026-12-01-n_plus_2-v4-pattern-n0_then_n1-p0.98.txt
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD
timeout 60 python3 - <<'PY'
import random, torch
from rltlab.engine import LLM, SamplingParams
from rltlab.model.checkpoint import load_model_and_tokenizer
model, tok = load_model_and_tokenizer("artifacts/ouro-tiny", dtype=torch.float32)
rng = random.Random(0)
prompts = [[0] + [rng.randrange(1, 1000) for _ in range(rng.randrange(8, 300))] for _ in range(24)]
params = [SamplingParams(temperature=(0.0, 1.0)[i % 2], seed=i, max_tokens=24, ignore_eos=True,
                         logprobs=0, exit_policy=("q_exit", "trace")[i % 3 == 0],
                         exit_policy_args={"depths": [4] + [rng.choice([1, 2, 3, 4]) for _ in range(24)]}
                         if i % 3 == 0 else {})
          for i in range(24)]
outs = {}
for fused in (False, True):
    llm = LLM(model, device="cuda", dtype=torch.float32, decode_path="static", fused_prefill=fused,
              max_num_seqs=8, prefill_chunk=96, max_num_batched_tokens=512)
    outs[fused] = llm.generate(prompts, params)
pairs = [(a.outputs[0], b.outputs[0]) for a, b in zip(outs[False], outs[True])]
same = sum(a.token_ids == b.token_ids and a.exit_depths == b.exit_depths for a, b in pairs)
diff = max(abs(x - y) for a, b in pairs if a.token_ids == b.token_ids
           for x, y in zip(a.logprobs, b.logprobs))
print(f"CUDA fp32 fused vs gather prefill: identical tokens and depths {same}/24, "
      f"max |logprob diff| {diff:.2e}")
PY
timeout 120 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W3 --modes graph-gather-prefill,graph --out $OUT/prefill.json > $OUT/prefill.log 2>&1
echo "prefill bench rc $?"; grep -v '^{' $OUT/prefill.log | tail -30
run() {  # name, args...: one depth_gain run; its log and last-line JSON appended to replays.*
  local name=$1; shift
  timeout 80 python3 -m rltlab.bench.depth_gain --preset ouro-1.4b --device cuda --dtype bfloat16 "$@" > /tmp/$name.log 2>&1
  echo "$name rc $?: $(grep '^gain' /tmp/$name.log)"
  { echo "== $name: $*"; cat /tmp/$name.log; } >> $OUT/replays.log
  echo "{\"name\": \"$name\", \"result\": $(tail -1 /tmp/$name.log)}" >> $OUT/replays.jsonl
}
[ -n "$N1" ] && run n1-c1 --concurrency 1 --pattern "$(cat $N1)"
[ -n "$N1" ] && run n1-c64 --concurrency 64 --pattern "$(cat $N1)"
[ -n "$N0" ] && run n0n1-c64 --concurrency 64 --pattern "$(cat $N0)"
timeout 280 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W3 W4 W6 W7 --modes graph --out $OUT/engine.json > $OUT/engine.log 2>&1
echo "engine bench rc $?"; grep -v '^{' $OUT/engine.log | tail -40
