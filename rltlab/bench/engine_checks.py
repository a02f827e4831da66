"""Pieces of `python -m rltlab.bench.engine`: bandwidth accounting, the W4 depth gain, the
full-weight update timing, the bf16-vs-fp32 agreement, the table and the JSON file."""
from __future__ import annotations

import copy
import json
import statistics
import time
from pathlib import Path

import torch

from rltlab.common.atomic import write_text_atomic
from rltlab.model.presets import random_prompts
from rltlab.bench.throughput import bench_engine
from rltlab.bench.ceilings import ModelCosts, mean_executed_rounds, work_of
from rltlab.engine import LLM, SamplingParams


def sync() -> None:
    """Wait for queued GPU work (no-op without CUDA), so wall times cover it."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_device_memory() -> None:
    """Hand cached GPU blocks back (the next engine needs its KV cache's memory)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def closed_loop(llm, prompts, params, concurrency: int, costs: ModelCosts
                ) -> tuple[dict, list]:
    """bench_engine's closed loop + what it computed (ceilings.work_of) -> (figures, the
    RequestOutputs in prompt order)."""
    outputs = []
    figures = bench_engine(llm, prompts, params, concurrency, keep=outputs)
    static = llm.llm_engine.runner.static
    shared_block = static.block_size if static is not None and static.groups is not None else 0
    figures["work"] = work_of(costs, outputs, shared_block)
    rounds = mean_executed_rounds(figures["work"])
    figures["mean_executed_rounds"] = None if rounds is None else round(rounds, 3)
    return figures, outputs


def prefill_only(llm, prompts, params, concurrency: int, costs: ModelCosts) -> dict:
    """The same closed loop with max_tokens 1: prefill (and the first token) alone."""
    firsts = [SamplingParams(**{**vars(p), "max_tokens": 1}) for p in params]
    figures, _ = closed_loop(llm, prompts, firsts, concurrency, costs)
    return {"wall_s": figures["wall_s"], "work": figures["work"]}


def bytes_per_token(model, rounds: float, context: float) -> float:
    """HBM bytes one decode token reads: shared-layer weights per executed round, lm_head once,
    and the K/V of `context` positions in every layer of every round."""
    cfg = model.config
    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    head_bytes = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    kv_bytes = (context * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim
                * model.lm_head.weight.element_size())
    return rounds * (layer_bytes + kv_bytes) + head_bytes


def summarize(name: str, entry: dict, model, spec: dict, copy_gb_s: float | None) -> None:
    """Add GB/s and % of the copy bandwidth to every mode's decode figure (in place)."""
    context = spec["prompt_len"] + spec["max_tokens"] / 2
    for mode, res in entry["modes"].items():
        decode = res.get("decode")
        if not decode:
            continue
        per_token = bytes_per_token(model, decode["mean_executed_rounds"], context)
        per_seq_rate = decode["decode_tok_s"] / spec["concurrency"]
        # At c > 1 the weights are shared by the batch: count them once per step's tokens.
        gb_s = per_seq_rate * per_token / 1e9 if spec["concurrency"] == 1 else None
        decode["gb_s"] = round(gb_s, 1) if gb_s else None
        if gb_s and copy_gb_s:
            decode["pct_of_copy_bw"] = round(100 * gb_s / copy_gb_s, 1)


def depth_gain(w3: dict, w4: dict, num_rounds: int) -> dict:
    out = {}
    for mode in w3["modes"]:
        a, b = w3["modes"][mode].get("decode"), w4["modes"].get(mode, {}).get("decode")
        if not (a and b):
            continue
        ideal = num_rounds / b["mean_executed_rounds"]
        gain = b["decode_tok_s"] / a["decode_tok_s"]
        out[mode] = {"gain": round(gain, 3), "ideal": round(ideal, 3),
                     "pct_of_ideal": round(100 * gain / ideal, 1),
                     "mean_selected_rounds": b["mean_selected_rounds"],
                     "mean_executed_rounds": b["mean_executed_rounds"]}
    return out


def _c1_graph(graphs: dict) -> tuple[int, object, str]:
    """(rounds, graph, what) of the c = 1 graph to time among StaticDecoder._graphs, keyed
    (key, grouped): a whole-token graph (engine.token_step; key (1, depth)) if the run captured
    one, else the one-round graph (key 1); (1, None, "eager") if neither."""
    token = [(key[1], graph) for (key, _), graph in graphs.items()
             if isinstance(key, tuple) and key[0] == 1 and isinstance(key[1], int)]
    if token:
        return (*token[0], "whole-token graph")
    rounds = [graph for (key, _), graph in graphs.items() if key == 1]
    return (1, rounds[0], "one-round graph") if rounds else (1, None, "eager")


def round_profile(decoder, repeats: int = 50, top: int = 8) -> dict:
    """Where a c=1 round's time goes: the GPU time of one round (graph replay, or the eager
    round), and the heaviest GPU kernels of an eager round (torch.profiler)."""
    rounds, graph, timed = _c1_graph(decoder._graphs)
    run = graph.replay if graph is not None else (lambda: decoder._round(1))
    run()
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        run()
    sync()
    out = {"gpu_ms_per_round": round(1e3 * (time.perf_counter() - t0) / repeats / rounds, 4),
           "timed": timed}
    if torch.cuda.is_available():
        kernels = kernel_profile(lambda: decoder._round(1), top=top)
        out["eager_kernel_us_per_round"] = kernels["kernel_us"]
        out["eager_kernels_per_round"] = kernels["kernels"]
        out["top_kernels"] = kernels["top_kernels"]
    return out


def kernel_profile(fn, calls: int = 5, top: int = 8) -> dict:
    """The GPU kernels of one fn() call (torch.profiler over `calls` calls, averaged):
    kernel_us (their total time), kernels (how many launches) and top_kernels, the heaviest as
    (name, us, launches). Only meaningful on CUDA."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        sync()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    events.sort(key=lambda e: -e.self_device_time_total)
    return {"kernel_us": round(sum(e.self_device_time_total for e in events) / calls, 1),
            "kernels": sum(e.count for e in events) // calls,
            "top_kernels": [(e.key[:60], round(e.self_device_time_total / calls, 1),
                             e.count // calls) for e in events[:top]]}


def weight_update(model, kv_gib: float, mode_kwargs=None) -> dict:
    """Time a full update of every parameter from device tensors, under CUDA graphs, and check
    that a same-weights update leaves greedy outputs and log-probs unchanged."""
    llm = LLM(model, max_num_seqs=4, max_model_len=256, kv_cache_memory_gib=min(kv_gib or 8.0, 8.0),
              **(mode_kwargs or {}))
    prompts = random_prompts(4, 64, model.config.vocab_size, seed=11)
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=0,
                        exit_policy="fixed")
    before = llm.generate(prompts, sp)
    engine = llm.llm_engine
    graphs = dict(engine.runner.static._graphs) if engine.runner.static else {}
    tensors = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    times = []
    for step in range(3):
        sync()
        t0 = time.perf_counter()
        engine.start_weight_update(engine.get_weight_version() + 1)
        engine.update_weights(tensors)
        engine.finish_weight_update()
        sync()
        times.append(time.perf_counter() - t0)
    after = llm.generate(prompts, sp)
    same = all(a.token_ids == b.token_ids and a.logprobs == b.logprobs
               for a, b in zip(before, after))
    recaptured = any(engine.runner.static._graphs.get(k) is not g for k, g in graphs.items())
    params = sum(t.numel() for _, t in tensors)
    del llm, tensors
    free_device_memory()
    return {"parameters": params, "update_s": round(statistics.median(times), 4),
            "outputs_identical": same, "graphs_recaptured": recaptured,
            "versions": [o.weight_versions[-1] for o in after][:1]}


def bf16_agreement(model, kv_gib: float, num_prompts: int = 8, max_tokens: int = 64,
                   prompts=None, **engine_kwargs) -> dict:
    """Engine (model dtype) vs a teacher-forced fp32 forward of the same model: greedy token
    agreement and |log-prob difference| of the engine's tokens."""
    prompts = prompts or random_prompts(num_prompts, 128, model.config.vocab_size, seed=13)
    llm = LLM(model, max_num_seqs=len(prompts),
              max_model_len=max(map(len, prompts)) + max_tokens,
              kv_cache_memory_gib=min(kv_gib or 16.0, 16.0), **engine_kwargs)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                ignore_eos=True, logprobs=0, exit_policy="fixed"))
    del llm
    reference = copy.deepcopy(model).float()
    agree, diffs = [], []
    with torch.no_grad():
        for prompt, out in zip(prompts, outs):
            ids = torch.tensor([prompt + out.token_ids[:-1]],
                               device=reference.lm_head.weight.device)
            logp = torch.log_softmax(reference(ids).final_logits[0].float(), -1)[len(prompt) - 1:]
            tokens = torch.tensor(out.token_ids, device=logp.device)
            agree += (logp.argmax(-1) == tokens).tolist()
            chosen = logp.gather(-1, tokens[:, None]).squeeze(-1).cpu()
            diffs += (chosen - torch.tensor(out.logprobs)).abs().tolist()
    del reference
    free_device_memory()
    diffs.sort()
    return {"tokens": len(agree), "token_agreement": round(sum(agree) / len(agree), 4),
            "logprob_absdiff_mean": round(sum(diffs) / len(diffs), 5),
            "logprob_absdiff_p99": round(diffs[int(0.99 * (len(diffs) - 1))], 5),
            "logprob_absdiff_max": round(diffs[-1], 5)}


def bf16_paths(model, args) -> dict:
    """bf16_agreement for the static (graph) and gather paths, on the benchmark model (random
    weights: near-uniform logits, many near-ties) and on the trained embedded model."""
    from rltlab.model.checkpoint import load_model_and_tokenizer
    from rltlab.pretrain.data import make_arithmetic_problems
    from rltlab.eval.tasks import arithmetic_prompt
    from rltlab.common.paths import embedded_model_dir
    out = {}
    trained, tokenizer = load_model_and_tokenizer(embedded_model_dir(),
                                                  dtype=model.lm_head.weight.dtype,
                                                  device=model.lm_head.weight.device)
    problems = [arithmetic_prompt(tokenizer, p.question)
                for p in make_arithmetic_problems(16, seed=5, split="heldout")]
    for label, net, prompts in (("random", model, None), ("embedded", trained, problems)):
        for path in ("static", "gather"):
            out[f"{label}_{path}"] = bf16_agreement(net, args.kv_gib, prompts=prompts,
                                                    decode_path=path)
    return out


def print_table(results: dict) -> None:
    print(f"\n# {results['model']} on {results.get('gpu', results['device'])} "
          f"({results['dtype']}); copy bandwidth {results.get('copy_bandwidth_gb_s')} GB/s, "
          f"matmul {results.get('matmul_tflop_s')} TFLOP/s")
    print(f"{'load':>4} {'mode':>8} {'decode tok/s':>13} {'GB/s':>7} {'% bw':>6} "
          f"{'e2e tok/s':>10} {'TTFT ms':>9} {'TPOT ms':>9} {'rounds':>7} {'ceiling':>9} "
          f"{'% ceil':>7} {'prefill % mm':>12}")
    for name, entry in results["workloads"].items():
        for mode, res in entry["modes"].items():
            if "error" in res:
                print(f"{name:>4} {mode:>8} failed: {res['error'][:80]}")
                continue
            d, loop = res.get("decode", {}), res.get("closed_loop", {})
            rounds = d.get("mean_executed_rounds", loop.get("mean_executed_rounds"))
            print(f"{name:>4} {mode:>8} {d.get('decode_tok_s', '-'):>13} {d.get('gb_s') or '-':>7} "
                  f"{d.get('pct_of_copy_bw') or '-':>6} {loop.get('tok_s', '-'):>10} "
                  f"{loop.get('ttft_ms', '-'):>9} {loop.get('tpot_ms', '-'):>9} "
                  f"{rounds or '-':>7} {res.get('ceiling_tok_s') or '-':>9} "
                  f"{res.get('pct_of_ceiling') or '-':>7} "
                  f"{res.get('prefill_pct_of_matmul') or '-':>12}")
            if "independent" in res:
                solo = res["independent"]
                print(f"{name:>4} {mode:>8} independent: {solo['tok_s']} tok/s "
                      f"({solo.get('pct_of_ceiling')}% of the ceiling); groups "
                      f"{res['group_speedup']}x (rounds {res['round_speedups']}), same tokens "
                      f"{res['same_tokens']}, mean length "
                      f"{res['mean_output_tokens']}, stopped {res['stopped_fraction']}")
    for mode, gain in results.get("w4_gain", {}).items():
        print(f"W4/W3 decode gain ({mode}): {gain['gain']}x, ideal {gain['ideal']}x "
              f"({gain['pct_of_ideal']}%), rounds selected {gain['mean_selected_rounds']} / "
              f"executed {gain['mean_executed_rounds']}")
    for pair, modes in results.get("depth_pairs", {}).items():
        for mode, g in modes.items():
            print(f"{pair} end to end ({mode}): {g['e2e_gain']}x, ideal {g['ideal_e2e_gain']}x "
                  f"({g['pct_of_ideal_e2e']}%); decode {g['decode_gain']}x; prefill "
                  f"{g['prefill_s']} s + decode {g['decode_s']} s, rounds {g['base_rounds']} -> "
                  f"{g['cheap_rounds']}")
    for key in ("weight_update", "bf16_vs_fp32"):
        if key in results:
            print(f"{key}: {json.dumps(results[key])}")


def save(results: dict, path) -> None:
    if path:
        write_text_atomic(Path(path), json.dumps(results, indent=1))
