"""A record of call 4 of 2026-12-02-s4, run at 6a1da06. The two-tile option it measured lost
(W1 220.7 against 227.9 tok/s, round 1.112 against 1.069 ms, same run) and was removed, so at
later commits its 1-tile and 2-tile runs are the same kernels.

Issue 17, W1: does loading two weight tiles before the PDL wait (kernels.small_batch
PREFETCH_TILES = 2, instead of 1) shorten the one-row round? And the RoPE + K/V fusion
(EngineConfig.fused_qkv_rope) against its baseline, in the same run.

W1 (Ouro-1.4B shape, random weights, bf16, graph mode) run by rltlab.bench.engine.run_mode, in
this order: default (fused RoPE, 1 tile), graph-unfused-rope (1 tile), fused RoPE with 2 tiles,
default again (drift check). Each: decode tok/s (median of 3) and the round's GPU time.
Then exactness: the embedded model in fp32, 6 requests at one row, 1 tile against 2 tiles:
the loads move, the summation order does not, so tokens and log-probs must be bit-identical.
Last line: JSON.

    python docs/experiments/scripts/prefetch_probe_h200.py [--device cuda]
"""
import json
import sys
from types import SimpleNamespace

import torch

from rltlab.bench.__main__ import build_model, prompts_for
from rltlab.bench.ceilings import ModelCosts
from rltlab.bench.engine import WORKLOADS, run_mode, scaled, workload_params
from rltlab.engine import LLM, SamplingParams
from rltlab.kernels import small_batch
from rltlab.model.checkpoint import load_model_and_tokenizer

RUNS = [("default", "graph", 1), ("unfused-rope", "graph-unfused-rope", 1),
        ("prefetch-2", "graph", 2), ("default-again", "graph", 1)]


def timings(device: str, scale: float) -> dict:
    dtype = "bfloat16" if device == "cuda" else "float32"
    model = build_model(SimpleNamespace(model=None, preset="ouro-1.4b" if device == "cuda"
                                        else "tiny", device=device, dtype=dtype))
    spec = scaled(WORKLOADS["W1"], scale)
    prompts = prompts_for(spec["requests"], spec["prompt_len"], model.config.vocab_size, seed=7)
    params = workload_params(spec, model.config.num_rounds, spec["requests"],
                             model.config.vocab_size)
    costs, out = ModelCosts.of(model), {}
    for name, mode, tiles in RUNS:
        small_batch.PREFETCH_TILES = tiles
        res = run_mode(model, spec, mode, prompts, params, 4.0, costs)
        out[name] = {"mode": mode, "prefetch_tiles": tiles, "decode": res["decode"],
                     "round": res.get("round")}
        gpu = (res.get("round") or {}).get("gpu_ms_per_round")
        print(f"W1 {name:>14} ({mode}, {tiles} tile(s)): {res['decode']['decode_tok_s']} tok/s "
              f"{res['decode'].get('runs_tok_s')}, round {gpu} ms", flush=True)
    small_batch.PREFETCH_TILES = 1
    return out


def exactness(device: str) -> dict:
    model, _ = load_model_and_tokenizer("artifacts/ouro-tiny", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = [[0] + torch.randint(1, 1000, (int(n),), generator=g).tolist()
               for n in torch.randint(8, 300, (6,), generator=g)]
    params = [SamplingParams(temperature=(0.0, 1.0)[i % 2], seed=i, ignore_eos=True,
                             max_tokens=24, logprobs=0) for i in range(6)]
    outs = {}
    for tiles in (1, 2):
        small_batch.PREFETCH_TILES = tiles
        llm = LLM(model, device=device, dtype=torch.float32, decode_path="static",
                  max_num_seqs=1)
        outs[tiles] = [o.outputs[0] for o in llm.generate(prompts, params)]
    small_batch.PREFETCH_TILES = 1
    same = sum(a.token_ids == b.token_ids and a.logprobs == b.logprobs
               for a, b in zip(outs[1], outs[2]))
    print(f"{device} fp32 one row, 2 tiles against 1: bit-identical {same}/6", flush=True)
    return {"bit_identical": f"{same}/6"}


if __name__ == "__main__":
    device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cpu"
    scale = 1.0 if device == "cuda" else 0.05
    print(json.dumps({"exactness": exactness(device), "W1": timings(device, scale)}))
