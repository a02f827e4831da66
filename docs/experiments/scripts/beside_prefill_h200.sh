#!/bin/bash
# As run at 6ef2f54. Since then the alternating turns are gone (they lost to prefill first) and
# the option is EngineConfig.prefill_first; mode graph-beside-prefill no longer exists.
# Issue 17, next device call: decode rows keep their round windows while other rows prefill
# (EngineConfig.windows_beside_prefill, round_window.py) against the default, same run.
# 1. Exactness on the embedded model (fp32, Triton kernels, CUDA graphs; a closed loop with more
#    requests than rows): beside-prefill vs round steps with gather prefill.
# 2. W3 W4, then W6 W7, with modes graph and graph-beside-prefill: closed-loop tok/s, each
#    depth pair within one run. Also the first timing of the non-blocking batch copies
#    (ModelRunner.prepare) and the one-list prefill exit rounds: prefill % of matmul against
#    2026-12-02's 58-63% (docs/benchmarks/2026-12-02-h200.md).
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 100 python3 - <<'PY'
import random, torch
from rltlab.engine import LLM, SamplingParams
from rltlab.model.checkpoint import load_model_and_tokenizer
model, tok = load_model_and_tokenizer("artifacts/ouro-tiny", dtype=torch.float32)
rng = random.Random(0)
prompts = [[0] + [rng.randrange(1, 1000) for _ in range(rng.randrange(8, 300))] for _ in range(32)]
params = [SamplingParams(temperature=(0.0, 1.0)[i % 2], seed=i, max_tokens=rng.randrange(16, 40),
                         ignore_eos=True, logprobs=0, exit_policy="trace",
                         exit_policy_args={"depths": [4] + [rng.choice([1, 2, 3, 4]) for _ in range(40)]})
          for i in range(32)]
outs = {}
for name, kw in (("rounds", dict(fused_tokens=False, fused_prefill=False)),
                 ("beside", dict(windows_beside_prefill=True))):
    llm = LLM(model, device="cuda", dtype=torch.float32, decode_path="static", max_num_seqs=8,
              prefill_chunk=96, max_num_batched_tokens=512, **kw)
    outs[name] = [o.outputs[0] for o in llm.generate(prompts, params)]
pairs = list(zip(outs["beside"], outs["rounds"]))
same = sum(a.token_ids == b.token_ids and a.exit_depths == b.exit_depths for a, b in pairs)
diff = max(abs(x - y) for a, b in pairs if a.token_ids == b.token_ids
           for x, y in zip(a.logprobs, b.logprobs))
print(f"cuda fp32 beside-prefill vs round steps + gather prefill: identical {same}/32, "
      f"max |logprob diff| {diff:.2e}")
PY
for pair in "W3 W4" "W6 W7"; do
  name=${pair// /_}
  timeout 240 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
    --workload $pair --modes graph,graph-beside-prefill --out $OUT/beside_$name.json \
    > $OUT/beside_$name.log 2>&1
  echo "bench $pair rc $?"; grep -v '^{' $OUT/beside_$name.log | tail -8
done
