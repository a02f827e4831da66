#!/bin/bash
# Issue 17: round windows for mixed host-fixed depths (rltlab/engine/round_window.py), batched
# admission, from-start prefill chunks through SDPA and the fused SiLU * up.
# CUDA exactness check on the embedded model (fp32, Triton kernels, CUDA graphs): the default
# engine and the ragged one (round_window=0) vs the round-per-step engine with gather-path
# prefill; then the engine bench (W3 W4 W6 W7, graph = windows for W4 / W7) and the baseline
# graph-ragged (whole tokens deepest first) for W4 / W7; then the per-step profile
# (closed_loop_profile_h200.py: prefill kernels, wall vs GPU kernel time per decode step).
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 90 python3 - <<'PY'
import random, torch
from rltlab.engine import LLM, SamplingParams
from rltlab.model.checkpoint import load_model_and_tokenizer
model, tok = load_model_and_tokenizer("artifacts/ouro-tiny", dtype=torch.float32)
rng = random.Random(0)
prompts = [[0] + [rng.randrange(1, 1000) for _ in range(rng.randrange(8, 300))] for _ in range(24)]
params = [SamplingParams(temperature=0.0, seed=i, max_tokens=rng.randrange(16, 40), ignore_eos=True,
                         logprobs=(0, None)[i % 4 == 3],
                         exit_policy=("trace", "fixed")[i % 3 == 1],
                         exit_policy_args={"depths": [4] + [rng.choice([1, 2, 3, 4]) for _ in range(40)]}
                         if i % 3 != 1 else {"depth": 1 + i % 4})
          for i in range(24)]
outs, windows = {}, {}
for name, kw in (("rounds", dict(fused_tokens=False, fused_prefill=False)),
                 ("ragged", dict(round_window=0)),
                 ("windows", {})):
    llm = LLM(model, device="cuda", dtype=torch.float32, decode_path="static", max_num_seqs=8,
              prefill_chunk=96, max_num_batched_tokens=512, **kw)
    rw = llm.llm_engine._round_window
    if rw is not None:
        step, calls = rw.step, []
        rw.step = lambda plan: calls.append(plan.num_steps) or step(plan)
    outs[name] = llm.generate(prompts, params)
    windows[name] = calls if rw is not None else None
for other in ("ragged", "windows"):
    pairs = [(a.outputs[0], b.outputs[0]) for a, b in zip(outs["rounds"], outs[other])]
    same = sum(a.token_ids == b.token_ids and a.exit_depths == b.exit_depths for a, b in pairs)
    diff = max((abs(x - y) for a, b in pairs if a.token_ids == b.token_ids and a.logprobs
                for x, y in zip(a.logprobs, b.logprobs)), default=0.0)
    print(f"CUDA fp32 {other} vs round steps + gather prefill: identical tokens and depths {same}/24, "
          f"max |logprob diff| {diff:.2e}")
print(f"windows taken: {len(windows['windows'])}, round steps in them: {sum(windows['windows'])}")
PY
timeout 270 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W3 W4 W6 W7 --modes graph --out $OUT/engine.json > $OUT/engine.log 2>&1
echo "engine bench rc $?"; grep -v '^{' $OUT/engine.log | tail -14
timeout 140 python3 -m rltlab.bench.engine --preset ouro-1.4b --device cuda --dtype bfloat16 \
  --workload W4 W7 --modes graph-ragged --out $OUT/ragged.json > $OUT/ragged.log 2>&1
echo "ragged bench rc $?"; grep -v '^{' $OUT/ragged.log | tail -8
timeout 100 python3 docs/experiments/scripts/closed_loop_steps.py W7 graph graph-ragged > $OUT/steps.log 2>&1
echo "closed-loop steps rc $?"; grep -v '^{' $OUT/steps.log | tail -3
timeout 120 python3 docs/experiments/scripts/closed_loop_profile_h200.py > $OUT/profile.log 2>&1
echo "profile rc $?"; python3 - <<'PY'
import json, os
d = json.loads(open(os.environ["OUT"] + "/profile.log").read().splitlines()[-1])
for r in d["prefill"]:
    print({k: v for k, v in r.items() if k != "top_kernels"})
    for k in r["top_kernels"][:8]:
        print("   ", k)
for r in d["decode"]:
    print({k: r[k] for k in ("workload", "mode", "wall_ms_per_step", "tokens_per_step", "tok_s",
                             "gpu_kernel_ms_per_step", "gpu_busy_pct")})
PY
