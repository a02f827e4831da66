"""Issue 17 (W1): the one-row round's kernel shapes re-tuned inside the engine's round.

    python docs/experiments/scripts/w1_tiles_h200.py [--sweep first|...|fifth]

The GEMV tiles (kernels.small_batch.TILES) were picked by sweeps of same-shape GEMV chains,
before PDL and the L2 prefetch; the decode attention splits W1's 256-key range into 4 (one
64-key tile each) plus a merge kernel. Here each variant changes one shape's tiles (or the
attention's split count) in the real one-row round: a fresh engine (mode graph, the W1
workload), its whole-token graph captured by a W1 warm-up, then the GPU time of one round
(graph replay, 200 repeats, ms / round; the same measure as bench.engine's
round.gpu_ms_per_round) and one W1 decode phase (tok/s). The sweep's base tiles run first, in
the middle and last. Last line: JSON.
"""
import argparse
import functools
import gc
import json

import torch

from rltlab.bench import engine as bench
from rltlab.bench.__main__ import add_model_arguments, build_model, prompts_for
from rltlab.bench.ceilings import ModelCosts
from rltlab.bench.engine_checks import free_device_memory, round_profile
from rltlab import kernels
from rltlab.kernels import paged_attention, small_batch

QKV, O, GATE_UP, DOWN = (6144, 2048), (2048, 2048), (11264, 2048), (2048, 5632)
# Sweeps: (name, shape or "splits", value); each variant on top of the sweep's base tiles
# (over small_batch.TILES), "previous" instead of them: the one-row tiles before the sixth
# session. "first" ran in its call 2, "second" (around first's winner, gate/up (4,1024,4,2))
# in call 3, both before TILES took their winners; "third" around the new TILES.
PREVIOUS = {GATE_UP: (4, 512, 2, 2), O: (4, 1024, 4, 3)}
GATE_UP_1024 = {**PREVIOUS, GATE_UP: (4, 1024, 4, 2)}
SWEEPS = {
    "first": (PREVIOUS, [
        ("default", None, None),
        ("attention 1 split", "splits", 1), ("attention 2 splits", "splits", 2),
        ("o (4,1024,4,3,2)", O, (4, 1024, 4, 3, 2)), ("o (8,512,2,3,2)", O, (8, 512, 2, 3, 2)),
        ("o (4,512,2,3,4)", O, (4, 512, 2, 3, 4)),
        ("default", None, None),
        ("down (8,512,2,5,2)", DOWN, (8, 512, 2, 5, 2)),
        ("down (8,512,2,5,8)", DOWN, (8, 512, 2, 5, 8)),
        ("down (4,512,2,5,4)", DOWN, (4, 512, 2, 5, 4)),
        ("gate_up (4,1024,4,2)", GATE_UP, (4, 1024, 4, 2)),
        ("gate_up (4,512,2,3)", GATE_UP, (4, 512, 2, 3)),
        ("gate_up (8,512,4,3)", GATE_UP, (8, 512, 4, 3)),
        ("qkv (4,512,2,2)", QKV, (4, 512, 2, 2)), ("qkv (8,1024,4,3)", QKV, (8, 1024, 4, 3)),
        ("default", None, None)]),
    "second": (GATE_UP_1024, [
        ("base", None, None),
        ("gate_up (4,1024,4,3)", GATE_UP, (4, 1024, 4, 3)),
        ("gate_up (4,2048,4,2)", GATE_UP, (4, 2048, 4, 2)),
        ("gate_up (4,2048,8,2)", GATE_UP, (4, 2048, 8, 2)),
        ("gate_up (8,1024,4,2)", GATE_UP, (8, 1024, 4, 2)),
        ("gate_up (4,1024,8,2)", GATE_UP, (4, 1024, 8, 2)),
        ("gate_up (2,1024,2,2)", GATE_UP, (2, 1024, 2, 2)),
        ("base", None, None),
        ("down (8,1024,4,5,4)", DOWN, (8, 1024, 4, 5, 4)),
        ("down (4,1024,4,3,4)", DOWN, (4, 1024, 4, 3, 4)),
        ("down (8,1024,4,3,2)", DOWN, (8, 1024, 4, 3, 2)),
        ("o (4,2048,4,2)", O, (4, 2048, 4, 2)), ("o (2,2048,4,2)", O, (2, 2048, 4, 2)),
        ("qkv (4,2048,4,2)", QKV, (4, 2048, 4, 2)),
        ("default tiles", "previous", None),
        ("base", None, None)]),
    "third": ({}, [
        ("base", None, None), ("previous tiles", "previous", None),
        ("o (4,2048,4,3)", O, (4, 2048, 4, 3)), ("o (8,2048,4,2)", O, (8, 2048, 4, 2)),
        ("o (4,2048,2,2)", O, (4, 2048, 2, 2)), ("o (2,2048,2,2)", O, (2, 2048, 2, 2)),
        ("base", None, None), ("previous tiles", "previous", None),
        ("down (8,512,4,5,4)", DOWN, (8, 512, 4, 5, 4)),
        ("down (16,512,4,5,4)", DOWN, (16, 512, 4, 5, 4)),
        ("base", None, None), ("previous tiles", "previous", None),
        ("base", None, None), ("previous tiles", "previous", None)]),
    # down with one K tile per program (every weight load issued before the PDL wait, as the
    # new o tiles do), and q/k/v once more
    "fourth": ({}, [
        ("base", None, None),
        ("down (8,512,2,2,11)", DOWN, (8, 512, 2, 2, 11)),
        ("down (4,1024,4,2,6)", DOWN, (4, 1024, 4, 2, 6)),
        ("down (8,1024,4,2,6)", DOWN, (8, 1024, 4, 2, 6)),
        ("down (16,512,4,2,11)", DOWN, (16, 512, 4, 2, 11)),
        ("base", None, None),
        ("down (8,512,2,3,6)", DOWN, (8, 512, 2, 3, 6)),
        ("qkv (8,2048,4,2)", QKV, (8, 2048, 4, 2)), ("qkv (4,1024,4,3)", QKV, (4, 1024, 4, 3)),
        ("base", None, None)]),
    # the decode attention (paged_attention.DECODE_CONFIG: 64-key tiles, so W1's 256-key range
    # in 4 splits, 4 warps, 2 stages) and the sandwich norms' warps (8)
    "fifth": ({}, [
        ("base", None, None),
        ("attention block_n 32", "attention", {"block_n": 32}),
        ("attention 2 warps", "attention", {"num_warps": 2}),
        ("attention 8 warps", "attention", {"num_warps": 8}),
        ("attention 1 stage", "attention", {"num_stages": 1}),
        ("attention 3 stages", "attention", {"num_stages": 3}),
        ("base", None, None),
        ("norm 4 warps", "norm_warps", 4), ("norm 16 warps", "norm_warps", 16),
        ("norm 2 warps", "norm_warps", 2),
        ("base", None, None)]),
}


def run_variant(model, spec, prompts, params, costs) -> dict:
    llm = bench.make_llm(model, spec, "graph", kv_gib=4.0)
    try:
        bench.warm_up(llm, prompts, params, 1)
        ms = round_profile(llm.llm_engine.runner.static, repeats=200)["gpu_ms_per_round"]
        tok_s = bench.decode_phase(llm, prompts[:1], params[:1], costs)["decode_tok_s"]
        return {"round_ms": round(ms, 4), "tok_s": tok_s}
    finally:
        del llm
        gc.collect()
        free_device_memory()


def main() -> dict:
    ap = argparse.ArgumentParser()
    add_model_arguments(ap)
    ap.add_argument("--sweep", choices=sorted(SWEEPS), default="fifth")
    ap.set_defaults(preset="ouro-1.4b", device="cuda", dtype="bfloat16")
    args = ap.parse_args()
    model = build_model(args)
    costs = ModelCosts.of(model)
    spec = bench.WORKLOADS["W1"]
    prompts = prompts_for(1, spec["prompt_len"], model.config.vocab_size, seed=7)
    params = bench.workload_params(spec, model.config.num_rounds, 1, model.config.vocab_size)
    default_tiles, default_splits = dict(small_batch.TILES), paged_attention._default_num_splits
    default_attention, default_norm = dict(paged_attention.DECODE_CONFIG), kernels.add_rmsnorm
    base, variants = SWEEPS[args.sweep]
    results = []
    for name, shape, value in variants:
        small_batch.TILES.clear()
        small_batch.TILES.update(default_tiles)
        small_batch.TILES.update({("one_row", *key): tiles for key, tiles in
                                  (PREVIOUS if shape == "previous" else base).items()})
        paged_attention._default_num_splits = default_splits
        paged_attention.DECODE_CONFIG.update(default_attention)
        kernels.add_rmsnorm = default_norm
        if shape == "splits":
            paged_attention._default_num_splits = lambda *a, splits=value: splits
        elif shape == "attention":
            paged_attention.DECODE_CONFIG.update(value)
        elif shape == "norm_warps":   # the one-row round calls kernels.add_rmsnorm at capture
            kernels.add_rmsnorm = functools.partial(default_norm, num_warps=value)
        elif shape not in (None, "previous"):
            small_batch.TILES[("one_row", *shape)] = value
        got = run_variant(model, spec, prompts, params, costs)
        results.append({"variant": name, **got})
        print(f"{name:24s} round {got['round_ms']:.4f} ms  W1 {got['tok_s']:.2f} tok/s", flush=True)
    out = {"workload": "W1", "dtype": args.dtype, "sweep": args.sweep,
           "base": {"x".join(map(str, key)): tiles for key, tiles in base.items()},
           "variants": results}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
