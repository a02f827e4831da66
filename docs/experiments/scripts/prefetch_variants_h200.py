"""Issue 17: variants of the one-row round's L2 prefetch (kernels/l2_prefetch.py) on W1, same run.

Each variant builds its engine in graph mode and runs bench.engine's W1 measurement (median of
three decode phases, the round's GPU time): the default (4 MiB per kernel, 4 KiB per prefetch
instruction), none, 1 KiB and 16 KiB per instruction, and the attention prefetching the whole
o projection (the GEMVs 4 MiB), then the default again (drift). Variants are applied by
patching the module constant CHUNK and static_decode.prefetch_plan before the engine is built
(its CUDA graphs capture them). Last line: JSON.

    python docs/experiments/scripts/prefetch_variants_h200.py [--device cpu --preset tiny]
"""
import json
import sys
from types import SimpleNamespace

from rltlab.bench.__main__ import build_model, prompts_for
from rltlab.bench.ceilings import ModelCosts
from rltlab.bench.engine import WORKLOADS, run_mode, workload_params
from rltlab.engine import static_decode
from rltlab.kernels import l2_prefetch

DEFAULT_PLAN, DEFAULT_CHUNK = static_decode.prefetch_plan, l2_prefetch.CHUNK


def whole_o_plan(layers, budget):
    """The default plan, with the attention prefetching all of the o projection's weight."""
    plan = DEFAULT_PLAN(layers, budget)
    for entry, w in zip(plan, layers):
        entry["attention"] = (w["w_o"], w["w_o"].nbytes)
    return plan


VARIANTS = {   # name: (mode, CHUNK, plan)
    "default": ("graph", DEFAULT_CHUNK, DEFAULT_PLAN),
    "none": ("graph-no-l2-prefetch", DEFAULT_CHUNK, DEFAULT_PLAN),
    "chunk-1k": ("graph", 1024, DEFAULT_PLAN),
    "chunk-16k": ("graph", 16384, DEFAULT_PLAN),
    "whole-o": ("graph", DEFAULT_CHUNK, whole_o_plan),
}


def main(device: str, preset: str) -> dict:
    model = build_model(SimpleNamespace(model=None, preset=preset, device=device,
                                        dtype="bfloat16" if device == "cuda" else "float32"))
    spec = WORKLOADS["W1"]
    prompts = prompts_for(1, spec["prompt_len"], model.config.vocab_size, seed=7)
    params = workload_params(spec, model.config.num_rounds, 1, model.config.vocab_size)
    out = {}
    for name in [*VARIANTS, "default"]:
        mode, l2_prefetch.CHUNK, static_decode.prefetch_plan = VARIANTS[name]
        res = run_mode(model, spec, mode, prompts, params, 2.0, ModelCosts.of(model))
        key = name if name not in out else f"{name}-again"
        out[key] = {"decode_tok_s": res["decode"]["decode_tok_s"],
                    "runs_tok_s": res["decode"].get("runs_tok_s"),
                    "gpu_ms_per_round": res.get("round", {}).get("gpu_ms_per_round")}
        print(key, out[key], flush=True)
    l2_prefetch.CHUNK, static_decode.prefetch_plan = DEFAULT_CHUNK, DEFAULT_PLAN
    return {"workload": "W1", "modes_used": {k: v[0] for k, v in VARIANTS.items()},
            "variants": out}


if __name__ == "__main__":
    argv = sys.argv
    device = argv[argv.index("--device") + 1] if "--device" in argv else "cuda"
    preset = argv[argv.index("--preset") + 1] if "--preset" in argv else "ouro-1.4b"
    print(json.dumps(main(device, preset)))
