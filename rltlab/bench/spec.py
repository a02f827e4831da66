"""Loop-aware speculative decoding: cost model on a big shape + end-to-end on the embedded model.

    python -m rltlab.bench.spec --preset ouro-1.4b --device cuda --dtype bfloat16

(a) On --preset/--model (random weights for a preset), c = 1, context --context tokens: the wall
    time (perf_counter around synchronize, median of --repeats after --warmup) of one draft pass
    (d rounds for 1 token + draft logits + argmax read back), of verification (rounds d+1..R over
    K+1 rows + logits + argmax read back) for K in --ks, and of one target-only token (R rounds
    for 1 token), for d in --draft-rounds, in the engine (the same runner calls
    rltlab.engine.spec_decode makes, static/CUDA-graph decode path where the engine uses it) and
    in the reference decoder (rltlab.engine.speculative.run_rounds on a LoopedKVCache).
    On the static path also: a target-only token as the engine decodes it (all R rounds in
    one launch, runner.run_token: t_token) and one whole greedy iteration as one device
    program (rltlab.engine.spec_graph: K chained drafts + verification + read-back: t_iter).
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
(c) With (a) and (b): the speedup (a)'s costs imply at the tau each engine drafter reached in
    (b) at c = 1 (K = --k), host loop and one program.
Last line: JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from rltlab.bench.__main__ import add_model_arguments, build_model, prompts_for
from rltlab.engine import LLM, DraftProposer, SamplingParams
from rltlab.engine.sequence import Span
from rltlab.engine.spec_decode import SpecDecoder, _View
from rltlab.engine.spec_graph import GreedySpecGraph
from rltlab.engine.speculative import run_rounds
from rltlab.model import LoopedKVCache


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, warmup: int, repeats: int) -> float:
    """Median wall seconds of fn() (synchronized before and after)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _engine_kwargs(args) -> dict:
    return {"decode_path": args.decode_path} if args.decode_path else {}


# --------------------------------------------------------------------------- (a) cost model
def engine_costs(model, args, ks, ds) -> dict:
    cfg, R, device = model.config, model.config.num_rounds, args.device
    llm = LLM(model, max_num_seqs=1, max_model_len=args.context + max(ks) + 8,
              max_num_batched_tokens=max(2048, args.context), kv_cache_memory_gib=1.0,
              **_engine_kwargs(args))
    eng = llm.llm_engine
    eng.add_request("a", prompts_for(1, args.context, cfg.vocab_size, 0)[0], SamplingParams(
        temperature=0.0, max_tokens=max(ks) + 4, ignore_eos=True, exit_policy="fixed"))
    while not eng.scheduler.running or not eng.scheduler.running[0].output_token_ids:
        eng.step()                                      # prefill
    seq = eng.scheduler.running[0]
    spec, lm_head = SpecDecoder(eng, DraftProposer(max(ks), 1)), eng.model.lm_head
    start, token = seq.num_tokens - 1, seq.output_token_ids[-1]

    def one_token(rounds):
        h = spec._rounds([_View(seq, Span(start, 1, None, True), [token])], rounds)
        return lm_head(h).argmax(-1).tolist()

    def verify(k, d):
        hidden = eng.model.model.embed_tokens(torch.full((k + 1,), token, device=device))
        span = Span(start, k + 1, torch.full((k + 1,), R), True, round=d, hidden=hidden)
        h = spec._rounds([_View(seq, span, [token] * (k + 1))], R - d)
        return eng.runner.logits(h).argmax(-1).tolist()

    def whole_token():   # target-only decoding's own step: all R rounds in one launch
        return lm_head(eng.runner.run_token([seq], R)).argmax(-1).tolist()

    def iteration(graph, k):   # the whole greedy iteration as one device program
        return graph.run([seq], [start], [k], k)

    t_target = timed(lambda: one_token(R), device, args.warmup, args.repeats)
    static = getattr(eng.runner, "static", None) is not None
    t_token = timed(whole_token, device, args.warmup, args.repeats) if static else None
    out = {}
    for d in ds:
        out[d] = {"t_draft": timed(lambda: one_token(d), device, args.warmup, args.repeats),
                  "t_target": t_target, "t_token": t_token,
                  "t_verify": {k: timed(lambda: verify(k, d), device, args.warmup, args.repeats)
                               for k in ks}}
        if static:
            graph = GreedySpecGraph(eng.runner, DraftProposer(max(ks), d))
            out[d]["t_iter"] = {k: timed(lambda: iteration(graph, k), device, args.warmup,
                                         args.repeats) for k in ks}
    out["decode_path"] = "static" if static else "gather"
    eng.abort_request("a")
    eng._drain_outputs()
    return out


def reference_costs(model, args, ks, ds) -> dict:
    return {d: _reference_costs(model, args, ks, d) for d in ds}


def _reference_costs(model, args, ks, d) -> dict:
    cfg, R, device = model.config, model.config.num_rounds, args.device
    dtype = next(model.parameters()).dtype
    cache = LoopedKVCache(cfg, 1, args.context + max(ks) + 2, dtype, device)
    ids = torch.tensor(prompts_for(1, args.context, cfg.vocab_size, 0), device=device)
    with torch.no_grad():
        model(ids, cache=cache, logits=False)
        col = cache.length
        emb = model.model.embed_tokens(ids[:, -1:].expand(1, max(ks) + 1))

        def one_token(rounds):
            h = run_rounds(model, emb[:, :1], torch.tensor([[col]], device=device), cache, col,
                           range(1, rounds + 1))
            return model.lm_head(h[:, -1]).argmax(-1).tolist()

        def verify(k):
            pos = torch.arange(col, col + k + 1, device=device)[None]
            h = run_rounds(model, emb[:, : k + 1], pos, cache, col, range(d + 1, R + 1))
            return model.lm_head(h).argmax(-1).tolist()

        return {"t_draft": timed(lambda: one_token(d), device, args.warmup, args.repeats),
                "t_target": timed(lambda: one_token(R), device, args.warmup, args.repeats),
                "t_verify": {k: timed(lambda: verify(k), device, args.warmup, args.repeats)
                             for k in ks}}


def implied(costs, k, alpha) -> tuple[float, float, float | None]:
    """-> (tau, speedup of the host-driven loop, speedup of the one-program iteration), both
    against the faster target-only step (round by round or whole-token)."""
    tau = (1 - alpha ** (k + 1)) / (1 - alpha)
    target = min(t for t in (costs["t_target"], costs.get("t_token")) if t)
    host = tau * target / ((k + 1) * costs["t_draft"] + costs["t_verify"][k])
    fused = tau * target / costs["t_iter"][k] if costs.get("t_iter") else None
    return tau, host, fused


def part_a(args) -> dict:
    model = build_model(args)
    ks = list(range(1, args.max_k + 1))
    res = {"model": args.model or f"random:{args.preset}", "dtype": args.dtype,
           "context": args.context, "formula": "host loop: speedup = tau * t_target / ((K+1) "
           "* t_draft + t_verify); one program: tau * t_target / t_iter; t_target = min(round "
           "by round, whole token); tau = (1 - a^(K+1)) / (1 - a)", "impl": {}}
    for impl, fn in (("engine", engine_costs), ("reference", reference_costs)):
        res["impl"][impl] = fn(model, args, ks, args.draft_rounds)
    res["engine_decode_path"] = res["impl"]["engine"].pop("decode_path")
    verify_path = ("static token rows" if res["engine_decode_path"] == "static"
                   else "gather")
    print(f"engine decode path for 1-token rounds: {res['engine_decode_path']}; "
          f"verification: {verify_path}")
    print(f"\n(a) {res['model']} {args.dtype} on {args.device}, c=1, context {args.context}; "
          f"ms per call (median of {args.repeats}); {res['formula']}")
    head = " ".join(f"{'a=' + str(a):>17}" for a in args.alphas)
    print(f"{'impl':>9} {'d':>2} {'K':>2} {'draft':>8} {'verify':>8} {'iter':>8} {'target':>8} "
          f"{'token':>8} {head}  (cells: tau/host-loop speedup/one-program speedup)")
    for impl, by_d in res["impl"].items():
        for d, c in by_d.items():
            c["implied"] = {}
            for k in ks:
                cells = [implied(c, k, a) for a in args.alphas]
                c["implied"][k] = {str(a): {"tau": t, "speedup": s, "speedup_one_program": f}
                                   for a, (t, s, f) in zip(args.alphas, cells)}
                ms = [c["t_draft"], c["t_verify"][k], c.get("t_iter", {}).get(k),
                      c["t_target"], c.get("t_token")]
                print(f"{impl:>9} {d:>2} {k:>2} "
                      + " ".join(f"{1e3 * t:>8.3f}" if t else f"{'-':>8}" for t in ms) + " "
                      + " ".join(f"{t:>5.2f}/{s:<5.2f}/{f or 0:<5.2f}" for t, s, f in cells))
    del model
    if torch.device(args.device).type == "cuda":
        torch.cuda.empty_cache()
    return res


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


def engine_runs(model, prompts, configs, conc, temperature, args) -> list[dict]:
    """Every config (target only first) --tiny-repeats times, interleaved (config order
    rotates each repeat, so slow phases of a shared machine hit every config); median time."""
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
        proposer, llm.llm_engine.config.fused_spec = proposers[name]
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
        steps = sum(s["steps"] for s in stats)
        drafted = sum(s["drafted"] for s in stats)
        med = statistics.median(secs[name])
        proposer = proposers[name][0]
        rows.append({"impl": "engine", "config": name, "tokens": sum(map(len, toks)),
                     "draft_rounds": proposer.draft_rounds if proposer else None,
                     "seconds": med, "seconds_all": secs[name],
                     "tok_s": sum(map(len, toks)) / med,
                     "tau": sum(s["emitted"] for s in stats) / steps if steps else 1.0,
                     "acceptance": sum(s["accepted"] for s in stats) / drafted if drafted
                     else None, "identical_prompts": sum(a == b for a, b in zip(toks, ref))})
    return rows


def _paired(base: dict, row: dict) -> float:
    """Median over the interleaved repeats of base seconds / row seconds (same tokens)."""
    return statistics.median(b / r for b, r in zip(base["seconds_all"], row["seconds_all"]))


def part_b(args) -> dict:
    from rltlab import workbench as W
    from rltlab.draft_heads.evaluate import eval_prompts, measure
    model, tokenizer, model_dir = W.load_model(args.tiny_model, dtype=args.tiny_dtype,
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
                groups.append(engine_runs(model, prompts, proposers, conc, temperature, args))
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


def implied_at_measured_tau(a: dict, b: dict) -> list[dict]:
    """(a)'s big-shape costs at the tau each engine drafter reached in (b) at c = 1:
    speedup = tau * t_target / t_iter (one program) and / ((K+1) t_draft + t_verify)."""
    costs, k, out = a["impl"]["engine"], b["k"], []
    for run in b["runs"]:
        if run["concurrency"] != 1:
            continue
        for row in run["rows"]:
            c = costs.get(row.get("draft_rounds"))
            if row["impl"] != "engine" or c is None or k not in c["t_verify"]:
                continue
            target = min(t for t in (c["t_target"], c.get("t_token")) if t)
            host = (k + 1) * c["t_draft"] + c["t_verify"][k]
            out.append({"temperature": run["temperature"], "config": row["config"],
                        "d": row["draft_rounds"], "k": k, "tau": row["tau"],
                        "speedup_host_loop": row["tau"] * target / host,
                        "speedup_one_program": (row["tau"] * target / c["t_iter"][k]
                                                if c.get("t_iter") else None)})
    print(f"\n(c) {a['model']} costs from (a) at the tau measured in (b), c=1, K={k}")
    for r in out:
        print(f"T={r['temperature']:<4} {r['config']:<28} d={r['d']} tau {r['tau']:.2f}: "
              f"host loop {r['speedup_host_loop']:.2f}x, one program "
              f"{r['speedup_one_program'] or 0:.2f}x")
    return out


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
                    help="(b) engine: greedy iterations as one device program (the default, "
                    "EngineConfig.fused_spec), the host-driven loop, or both as configs")
    ap.add_argument("--train-steps", type=int, default=150)
    ap.add_argument("--train-rows", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--text-bytes", type=int, default=400_000)
    ap.add_argument("--head-inner", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (CPU: 1)")
    ap.add_argument("--decode-path", default=None,
                    help="engine decode path (EngineConfig.decode_path; default: the engine's)")
    ap.add_argument("--skip-a", action="store_true")
    ap.add_argument("--skip-b", action="store_true")
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.threads or args.device == "cpu":
        torch.set_num_threads(args.threads or 1)
    started = time.perf_counter()
    results = {"device": args.device, "args": vars(args)}
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
    main()
