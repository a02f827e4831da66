"""Part (a) of `python -m rltlab.bench.spec`: speculative-decoding costs vs K on a big shape
(engine: host loop and one-program iteration; reference decoder), the speedups they imply at a
per-token acceptance a, and (c) at the tau measured end to end. See rltlab/bench/spec.py."""
from __future__ import annotations

import statistics
import time

import torch

from rltlab.model.presets import random_prompts
from rltlab.bench.models import build_model
from rltlab.draft_heads.heads import build_component
from rltlab.engine import LLM, DraftProposer, SamplingParams
from rltlab.engine.sequence import Span
from rltlab.engine.spec.decoder import SpecDecoder, _View
from rltlab.engine.spec.draft_program import SpecGraph
from rltlab.model.speculative import run_rounds
from rltlab.model.architecture import LoopedKVCache


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
    eng.add_request("a", random_prompts(1, args.context, cfg.vocab_size, 0)[0], SamplingParams(
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
            graph = SpecGraph(eng.runner, DraftProposer(max(ks), d))
            out[d]["t_iter"] = {k: timed(lambda: iteration(graph, k), device, args.warmup,
                                         args.repeats) for k in ks}
            if args.big_head_inner:   # a trained head's own cost: the same shape, random values
                head = build_component("residual_mlp", eng.model, draft_rounds=d,
                                       inner=args.big_head_inner).to(
                    device=device, dtype=next(eng.model.parameters()).dtype)
                graph = SpecGraph(eng.runner, DraftProposer(max(ks), d, head))
                out[d]["t_iter_head"] = {k: timed(lambda: iteration(graph, k), device,
                                                  args.warmup, args.repeats) for k in ks}
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
    ids = torch.tensor(random_prompts(1, args.context, cfg.vocab_size, 0), device=device)
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


def _target_time(costs) -> float:
    """The faster target-only step: round by round, or whole-token (static path only)."""
    return min(t for t in (costs["t_target"], costs.get("t_token")) if t)


def speedups_at_tau(costs: dict, k: int, tau: float, head: bool = False) -> dict:
    """Speedup of the host-driven loop and of the one-program iteration at this tau, both
    against the faster target-only step (round by round or whole-token). head=True: the
    one-program iteration with a residual-MLP head drafting (t_iter_head: the head's own cost
    included), where it was measured."""
    target = _target_time(costs)
    host = (k + 1) * costs["t_draft"] + costs["t_verify"][k]
    t_iter = costs.get("t_iter_head" if head and costs.get("t_iter_head") else "t_iter")
    return {"tau": tau, "speedup_host_loop": tau * target / host,
            "speedup_one_program": tau * target / t_iter[k] if t_iter else None,
            "t_iter_includes_head": bool(head and costs.get("t_iter_head"))}


def implied(costs, k, alpha) -> tuple[float, float, float | None]:
    """-> (tau, host-loop speedup, one-program speedup) at per-token acceptance alpha."""
    s = speedups_at_tau(costs, k, (1 - alpha ** (k + 1)) / (1 - alpha))
    return s["tau"], s["speedup_host_loop"], s["speedup_one_program"]


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
                      + " ".join(f"{t:>5.2f}/{s:<5.2f}/{'-' if f is None else f'{f:.2f}':<5}"
                                 for t, s, f in cells))
    del model
    if torch.device(args.device).type == "cuda":
        torch.cuda.empty_cache()
    return res


def implied_at_measured_tau(a: dict, b: dict) -> list[dict]:
    """(a)'s big-shape costs at the tau each engine drafter reached in (b) at c = 1:
    speedup = tau * t_target / t_iter (one program) and / ((K+1) t_draft + t_verify). A COST
    MODEL: big-shape costs of random weights times the embedded model's tau. For trained heads
    t_iter is t_iter_head (a residual-MLP head of --big-head-inner drafting: its cost counted)."""
    costs, k, out = a["impl"]["engine"], b["k"], []
    for run in b["runs"]:
        if run["concurrency"] != 1:
            continue
        for row in run["rows"]:
            c = costs.get(row.get("draft_rounds"))
            if row["impl"] != "engine" or c is None or k not in c["t_verify"]:
                continue
            head = not row["config"].startswith("shallow")   # a head drafts: its cost counts
            out.append({"temperature": run["temperature"], "config": row["config"],
                        "d": row["draft_rounds"], "k": k,
                        **speedups_at_tau(c, k, row["tau"], head),
                        "by_kind": {kind: speedups_at_tau(c, k, tau, head)
                                    for kind, tau in row.get("tau_by_kind", {}).items()}})
    print(f"\n(c) {a['model']} costs from (a) at the tau measured in (b), c=1, K={k}; per "
          "workload: one program")
    for r in out:
        kinds = ", ".join(f"{kind} tau {v['tau']:.2f}: {_times(v['speedup_one_program'])}"
                          for kind, v in r["by_kind"].items())
        print(f"T={r['temperature']:<4} {r['config']:<28} d={r['d']} tau {r['tau']:.2f}: "
              f"host loop {r['speedup_host_loop']:.2f}x, one program "
              f"{_times(r['speedup_one_program'])} ({kinds})")
    return out


def _times(speedup: float | None) -> str:
    """A speedup as printed: "-" where there is none (no one-program path, e.g. on the CPU)."""
    return "-" if speedup is None else f"{speedup:.2f}x"
