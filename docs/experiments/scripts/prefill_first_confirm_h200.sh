#!/bin/bash
# As run at 1cbfcce-670cec2, when prefill first was mode graph-prefill-first and graph mixed the
# prefills with decode rows. Since then prefill first is the default (graph), and the old graph is
# graph-mixed-prefill.
# Issue 17: prefill-first turns (EngineConfig.prefill_turns="whole"), the confirming call.
# 1. Exactness on the embedded model (fp32, Triton kernels, CUDA graphs; a closed loop with more
#    requests than rows): prefill-first vs round steps with gather prefill.
# 2. Step-kind profiles of the W4 closed loop (closed_loop_steps.py): graph, graph-prefill-first
#    and graph-prefill-first with admissions once 16 slots are free.
# 3. W3 W4, then W6 W7, with modes graph and graph-prefill-first again: a second same-run pair
#    each, beside prefill_first_h200.sh's (2026-12-02 call 2).
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 100 python3 - <<'PY' 2>&1 | tee $OUT/exactness.log
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
                 ("first", dict(prefill_turns="whole"))):
    llm = LLM(model, device="cuda", dtype=torch.float32, decode_path="static", max_num_seqs=8,
              prefill_chunk=96, max_num_batched_tokens=512, **kw)
    outs[name] = [o.outputs[0] for o in llm.generate(prompts, params)]
pairs = list(zip(outs["first"], outs["rounds"]))
same = sum(a.token_ids == b.token_ids and a.exit_depths == b.exit_depths for a, b in pairs)
diff = max(abs(x - y) for a, b in pairs if a.token_ids == b.token_ids
           for x, y in zip(a.logprobs, b.logprobs))
print(f"cuda fp32 prefill-first vs round steps + gather prefill: identical {same}/32, "
      f"max |logprob diff| {diff:.2e}")
PY
timeout 130 python3 docs/experiments/scripts/closed_loop_steps.py W4 graph graph-prefill-first \
  graph-prefill-first+round_window_admit=16 --out $OUT/steps_W4.json > $OUT/steps_W4.log 2>&1
echo "steps W4 rc $?"; grep -v '^{' $OUT/steps_W4.log | cut -c1-700
for pair in "W3 W4" "W6 W7"; do
  name=${pair// /_}
  timeout 190 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
    --workload $pair --modes graph,graph-prefill-first --out $OUT/first_$name.json \
    > $OUT/first_$name.log 2>&1
  echo "bench $pair rc $?"; grep -v '^{' $OUT/first_$name.log | tail -8
done
