"""Loop-aware speculative decoding: cost model on a big shape + end-to-end on the embedded model.

    python -m rltlab.bench.spec --preset ouro-1.4b --device cuda --dtype bfloat16

(a) On --preset/--model (random weights for a preset), c = 1, context --context tokens: the wall
    time (perf_counter around synchronize, median of --repeats after --warmup) of one draft pass
    (d rounds for 1 token + draft logits + argmax read back), of verification (rounds d+1..R over
    K+1 rows + logits + argmax read back) for K in --ks, and of one target-only token (R rounds
    for 1 token), for d in --draft-rounds, in the engine (the same runner calls
    rltlab.engine.spec.decoder makes, static/CUDA-graph decode path where the engine uses it) and
    in the reference decoder (rltlab.model.speculative.run_rounds on a LoopedKVCache).
    On the static path also: a target-only token as the engine decodes it (all R rounds in
    one launch, runner.run_token: t_token) and one whole greedy iteration as one device
    program (rltlab.engine.spec.draft_program: K chained drafts + verification + read-back: t_iter).
    Implied speedup of one speculative iteration (K+1 draft passes: the pending token and K
    drafts, the last one only for its h_d; then one verification), t_target = the faster of
    round-by-round and t_token:
        host loop:    speedup(tau) = tau * t_target / ((K + 1) * t_draft + t_verify)
        one program:  speedup(tau) = tau * t_target / t_iter
    shown for tau = (1 - a^(K+1)) / (1 - a) at per-token acceptance a in --alphas.
(b) On the embedded model (--tiny-model, default artifacts/ouro-tiny; --tiny-dtype float32 so
    the T=0 identity check is not a bf16 tie-breaking test): tok/s at each --concurrency and
    --temperatures of target-only decoding (full depth), untrained shallow drafting d=1 and
    d=2 (the model's lm_head on h_d), and the trained components (default: the ones shipped
    under artifacts/ouro-tiny/draft_heads/, one config "trained d=<d>" each; --draft PATH...
    for others; none: a residual-MLP head trained here), all K = --k, for the engine path
    (LLMEngine + set_proposer; configs interleaved over --tiny-repeats, median) and the
    reference path (speculative_generate vs generate_plain; best of --tiny-repeats); tau,
    acceptance, head memory, identical outputs at T=0 (per prompt), speedup vs target-only
    and vs the faster untrained drafter, and which path is faster.
    --extra-k and --adaptive-k add, for the engine path, each trained drafter at another fixed
    K and with adaptive K (DraftProposer(adaptive=True): per sequence, +2 after a step that
    accepted every draft, -1 otherwise), interleaved with the rest.
(c) With (a) and (b): the speedup (a)'s costs imply at the tau each engine drafter reached in
    (b) at c = 1 (K = --k), host loop and one program, over all prompts and per workload
    (the held-out arithmetic and text halves: tau_by_kind in (b), by_kind in (c)).
Last line: JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from rltlab.bench.models import add_model_arguments
from rltlab.bench.spec_costs import _engine_kwargs, _sync, implied_at_measured_tau, part_a
from rltlab.engine import LLM, DraftProposer, SamplingParams
from rltlab.common.environment import git_commit


# ------------------------------------------------------------------ (b) end to end, tiny model
def trained_heads(model, tokenizer, args) -> tuple[dict, dict]:
    """{config name: component}, {config name: info}. --draft PATH...: those components;
    default: the components shipped with the embedded model (artifacts/ouro-tiny/draft_heads,
    when --tiny-model is the embedded one), else one residual-MLP head trained here."""
    from rltlab.draft_heads.selfdistill import shipped_components
    from rltlab.engine_patches.loop_draft import load_draft_component, read_metadata
    paths = args.draft if args.draft else ([] if args.tiny_model or args.train_inline
                                           else shipped_components())
    heads, info = {}, {}
    for path in paths:
        comp = load_draft_component(path, model)
        name = f"trained d={comp.draft_rounds}"
        name = name if name not in heads else f"{name} ({path})"
        meta = read_metadata(path)
        heads[name] = comp
        info[name] = {"loaded": str(path), "kind": comp.kind,
                      "command": meta.get("training", {}).get("command"),
                      "adapter_bytes": _adapter_bytes(comp)}
    if not heads:
        comp, info["trained d=1"] = _train_inline(model, tokenizer, args)
        heads["trained d=1"] = comp
    return heads, info


def _adapter_bytes(comp) -> int:
    return sum(p.numel() * p.element_size() for p in comp.adapter_parameters())


def _train_inline(model, tokenizer, args):
    from rltlab.draft_heads.heads import build_component
    from rltlab.draft_heads.train import distill, training_rows
    rows = training_rows(tokenizer, args.train_rows, args.seq_len, seed=0,
                         text_bytes=args.text_bytes).to(args.device)
    param = next(model.parameters())
    comp = build_component("residual_mlp", model, draft_rounds=1, inner=args.head_inner).to(
        device=param.device, dtype=param.dtype)
    started = time.perf_counter()
    log = distill(model, comp, rows, steps=args.train_steps, batch_size=16, lr=1e-3,
                  log_every=max(1, args.train_steps))
    return comp.eval(), {"trained_steps": args.train_steps, "rows": args.train_rows,
                         "seconds": time.perf_counter() - started, "last": log[-1],
                         "adapter_bytes": _adapter_bytes(comp)}


def _tau(stats: list[dict]) -> float:
    steps = sum(s["steps"] for s in stats)
    return sum(s["emitted"] for s in stats) / steps if steps else 1.0


def engine_runs(model, prompts, kinds, configs, conc, temperature, args) -> list[dict]:
    """Every config (target only first) --tiny-repeats times, interleaved (config order
    rotates each repeat, so slow phases of a shared machine hit every config); median time.
    tau overall and per workload (kinds[i] = prompt i's)."""
    llm = LLM(model, max_num_seqs=conc, block_size=16, kv_cache_memory_gib=0.5,
              max_model_len=max(map(len, prompts)) + args.max_tokens + 1,
              **_engine_kwargs(args))
    params = [SamplingParams(temperature=temperature, max_tokens=args.max_tokens, seed=17 + i,
                             exit_policy="fixed") for i in range(len(prompts))]
    proposers = {"target only": (None, True)}
    for name, proposer in configs.items():
        if args.spec_loop in ("one-program", "both"):
            proposers[name] = (proposer, True)
        if args.spec_loop in ("host", "both"):
            proposers[name + (" host loop" if args.spec_loop == "both" else "")] = (proposer,
                                                                                  False)
    names = list(proposers)

    def use(name):
        proposer, llm.llm_engine.config.execution.fused_spec = proposers[name]
        llm.set_proposer(proposer)

    secs, outs = {n: [] for n in names}, {}
    for name in names:
        use(name)
        llm.generate(prompts[:2], params[:2])                      # warm-up (graph capture)
    for rep in range(args.tiny_repeats):
        for i in range(len(names)):
            name = names[(i + rep) % len(names)]
            use(name)
            _sync(args.device)
            started = time.perf_counter()
            outs[name] = llm.generate(prompts, params)
            _sync(args.device)
            secs[name].append(time.perf_counter() - started)
    llm.set_proposer(None)
    rows, ref = [], [o.token_ids for o in outs["target only"]]
    for name in names:
        toks = [o.token_ids for o in outs[name]]
        stats = [o.spec_stats for o in outs[name] if o.spec_stats]
        drafted = sum(s["drafted"] for s in stats)
        med = statistics.median(secs[name])
        proposer = proposers[name][0]
        rows.append({"impl": "engine", "config": name, "tokens": sum(map(len, toks)),
                     "draft_rounds": proposer.draft_rounds if proposer else None,
                     "seconds": med, "seconds_all": secs[name],
                     "tok_s": sum(map(len, toks)) / med,
                     "tau": _tau(stats),
                     "tau_by_kind": {kind: _tau([o.spec_stats for o, k in zip(outs[name], kinds)
                                                 if k == kind and o.spec_stats])
                                     for kind in dict.fromkeys(kinds)},
                     "acceptance": sum(s["accepted"] for s in stats) / drafted if drafted
                     else None, "identical_prompts": sum(a == b for a, b in zip(toks, ref))})
    return rows


def _paired(base: dict, row: dict) -> float:
    """Median over the interleaved repeats of base seconds / row seconds (same tokens)."""
    return statistics.median(b / r for b, r in zip(base["seconds_all"], row["seconds_all"]))


def part_b(args) -> dict:
    from rltlab.model.checkpoint import load_model
    from rltlab.draft_heads.evaluate import eval_prompt_kinds, eval_prompts, measure
    model, tokenizer, model_dir = load_model(args.tiny_model, dtype=args.tiny_dtype,
                                               device=args.device)
    prompts = eval_prompts(tokenizer, model_dir, args.prompts)
    heads, head_info = trained_heads(model, tokenizer, args)
    param = next(model.parameters())
    heads = {n: h.to(device=param.device, dtype=param.dtype).eval() for n, h in heads.items()}
    k, res = args.k, {"model": str(model_dir), "dtype": args.tiny_dtype, "k": args.k,
                      "heads": head_info, "runs": []}
    proposers = {"shallow d=1": DraftProposer(k, 1), "shallow d=2": DraftProposer(k, 2)}
    ref_cfgs = {"shallow d=1": {"draft_rounds": 1}, "shallow d=2": {"draft_rounds": 2}}
    for name, head in heads.items():
        proposers[name] = DraftProposer(k, head.draft_rounds, head)
        ref_cfgs[name] = {"draft_rounds": head.draft_rounds, "head": head}
    for name, head in heads.items():   # engine only: K variants of the trained drafters
        for other in args.extra_k:
            proposers[f"{name} K={other}"] = DraftProposer(other, head.draft_rounds, head)
        for most in args.adaptive_k:
            proposers[f"{name} adaptive K<={most}"] = DraftProposer(most, head.draft_rounds,
                                                                    head, adaptive=True)
    keys = ["impl", "config", "tokens", "tok_s", "speedup", "vs_best_shallow",
            "paired_speedup", "paired_vs_best_shallow", "tau", "acceptance", "identical"]
    sizes = {n: i["adapter_bytes"] for n, i in head_info.items()}
    print(f"\n(b) {model_dir} ({args.tiny_dtype}) on {args.device}, {len(prompts)} prompts, "
          f"{args.max_tokens} new tokens (eos stops), K={k}, median of {args.tiny_repeats} "
          f"interleaved repeats (engine); head bytes {sizes}")
    for temperature in args.temperatures:
        for conc in args.concurrency:
            groups = []
            if "engine" in args.impls:
                groups.append(engine_runs(model, prompts, eval_prompt_kinds(args.prompts),
                                          proposers, conc, temperature, args))
            if "reference" in args.impls:
                ref_rows = measure(model, prompts, ref_cfgs, temperature=temperature,
                                   concurrency=conc, k=k, max_tokens=args.max_tokens,
                                   repeats=args.tiny_repeats)
                for r in ref_rows:
                    r["impl"] = "reference"
                    r["config"] = ("target only" if r["config"].startswith("target")
                                   else r["config"])
                groups.append(ref_rows)
            for group in groups:
                shallow = max((r for r in group if r["config"].startswith("shallow")),
                              key=lambda r: r["tok_s"])
                for r in group:
                    r["speedup"] = r["tok_s"] / group[0]["tok_s"]
                    r["vs_best_shallow"] = r["tok_s"] / shallow["tok_s"]
                    if "seconds_all" in r:      # paired: the same interleaved repeat
                        r["paired_speedup"] = _paired(group[0], r)
                        r["paired_vs_best_shallow"] = _paired(shallow, r)
                    same = r.get("identical_prompts", len(prompts))
                    r["identical"] = (f"{same}/{len(prompts)}"
                                      if temperature == 0 else "n/a")
            rows = [r for g in groups for r in g]
            best = {r["config"]: max((x for x in rows if x["config"] == r["config"]),
                                     key=lambda x: x["tok_s"])["impl"] for r in rows}
            res["runs"].append({"temperature": temperature, "concurrency": conc,
                                "rows": rows, "faster_impl": best})
            print(f"\nT={temperature} c={conc} (faster: {best})")
            print(" | ".join(f"{key:>10}" for key in keys))
            for r in rows:
                print(" | ".join(f"{r[key]:>10.3g}" if isinstance(r.get(key), float)
                                 else f"{str(r.get(key)):>10}" for key in keys))
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m rltlab.bench.spec", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(ap)
    ap.add_argument("--context", type=int, default=128, help="(a) tokens already in the cache")
    ap.add_argument("--max-k", type=int, default=8)
    ap.add_argument("--draft-rounds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.6, 0.8, 0.9])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--tiny-model", default=None, help="(b) model dir (default: embedded)")
    ap.add_argument("--tiny-dtype", default="float32")
    ap.add_argument("--tiny-repeats", type=int, default=5,
                    help="(b) repeats (engine: interleaved, median; reference: best of)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--extra-k", type=int, nargs="+", default=[],
                    help="(b) engine: also each trained drafter at these fixed K")
    ap.add_argument("--adaptive-k", type=int, nargs="+", default=[],
                    help="(b) engine: also each trained drafter with adaptive K up to each of "
                    "these (DraftProposer(adaptive=True))")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--draft", nargs="+", default=None,
                    help="(b) trained component dirs (default: the shipped ones, "
                    "artifacts/ouro-tiny/draft_heads/*; none there: train one here)")
    ap.add_argument("--train-inline", action="store_true",
                    help="(b) ignore the shipped components, train a residual MLP here")
    ap.add_argument("--impls", nargs="+", default=["engine", "reference"],
                    choices=["engine", "reference"], help="(b) implementations to time")
    ap.add_argument("--spec-loop", default="one-program", choices=["one-program", "host",
                                                                  "both"],
                    help="(b) engine: iterations as one device program (the default, "
                    "ExecutionConfig.fused_spec), the host-driven loop, or both as configs")
    ap.add_argument("--train-steps", type=int, default=150)
    ap.add_argument("--train-rows", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--text-bytes", type=int, default=400_000)
    ap.add_argument("--head-inner", type=int, default=512)
    ap.add_argument("--big-head-inner", type=int, default=2048,
                    help="(a) time t_iter with a residual-MLP head of this inner width at the "
                         "big shape (the shipped heads' width); 0: only the shallow drafter")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (CPU: 1)")
    ap.add_argument("--decode-path", default=None,
                    help="engine decode path (ExecutionConfig.decode_path; default: the engine's)")
    ap.add_argument("--skip-a", action="store_true")
    ap.add_argument("--skip-b", action="store_true")
    args = ap.parse_args(argv)
    if min([args.k, *args.extra_k, *args.adaptive_k]) < 1:
        ap.error("--k, --extra-k and --adaptive-k take K >= 1")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.threads or args.device == "cpu":
        torch.set_num_threads(args.threads or 1)
    started = time.perf_counter()
    results = {"commit": git_commit(), "argv": sys.argv[1:], "device": args.device, "args": vars(args)}
    if torch.device(args.device).type == "cuda":
        results["gpu"] = torch.cuda.get_device_name()
    with torch.no_grad():
        if not args.skip_a:
            results["a"] = part_a(args)
    if not args.skip_b:
        results["b"] = part_b(args)
        if "a" in results:
            results["c"] = implied_at_measured_tau(results["a"], results["b"])
    results["wall_s"] = time.perf_counter() - started
    print(json.dumps(results, default=str))
    return results


if __name__ == "__main__":
    from rltlab.common.command import run_command

    run_command(main)
