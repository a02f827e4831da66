"""Tree speculative decoding with lookahead heads against target-only decoding, end to end at
c = 1, greedy (issue 16's >= 2.0x lossless goal).

On the embedded model (fp32 by default) and its lookahead heads
(artifacts/ouro-tiny/draft_heads/lookahead_h4), the held-out prompts of
rltlab.draft_heads.evaluate.eval_prompts (half arithmetic, half text), max_tokens new tokens
(eos 0 stops), one request at a time:

  - target only: the paged engine (LLM.generate, max_num_seqs = 1, fixed depth R), the
    baseline every speedup is paired against;
  - the trees: root only (no drafts), chain K = 4, the artifact's own tree, and with
    --trees-from the trees of a JSON with "tree B=<b>" entries (--budgets), as the lookahead
    tree probe wrote (a script in the tree at 093d100); --only keeps the named ones. Each is
    run by
      - the engine (--paths engine): the same paged engine with a TreeProposer
        (rltlab.engine.spec.tree_graph; "engine <tree>"), ExecutionConfig.spec_pipeline = P
        for each P of --pipelines (up to P programs a step, each launched while the host
        handles the last one's tokens; "... P=<p>" where P is not the engine's default), and
        with --engine-compile on also with ExecutionConfig.compile ("... compiled", beside a
        "target only compiled" baseline row); --gemv-rows G > 1 also with
        ExecutionConfig.gemv_rows = G ("... gemv<=G": trees of at most G rows through the
        Triton GEMV path, kernels/small_batch.py); --lookup L > 0 also with a prompt-lookup
        chain ("<tree> +lookupL"), and --adaptive-lookup [RULE...] with it verified only where
        each rule says (TreeProposer(adaptive_lookup=RULE)): after a lookup hit ("hits", the
        default: "... adaptive") or where the next draft agrees with the heads ("agree":
        "... agree");
        --first-drafts also with the first iteration drafted from token 0's state ("...
        first", TreeProposer(first_drafts=True)); --launch-early also with each request's
        first program launched behind its prompt step ("... early",
        ExecutionConfig.launch_behind_prompt; target only's first token window too: "target
        only early" rows, among the baselines vs_faster takes the fastest of); --also-heads
        DIR... also with each of
        these lookahead heads in place of --heads ("... heads=<DIR's name>"), paired in the
        same run;
      - the standalone generator (--paths standalone): rltlab.model.tree_spec over the
        model's reference modules, and "<tree> compiled" under torch.compile
        (--compile-nodes: which node counts);
  - with --round-step-prompts, "target only (round-step prompts)": target only with
    ExecutionConfig.whole_prompt_steps off (each prompt in R round steps, as before
    rltlab.engine.prompt_step; every other config takes whole-prompt steps).

Every config runs --repeats times, interleaved (the order rotates each repeat); a config's
speedup is the median of its per-repeat time ratios against target only (paired), with mean,
SE and range. With "target only compiled" or "target only early", vs_faster pairs each repeat
against the fastest target-only row; an --also-heads row's vs_heads pairs it against the same
config with --heads. identical: prompts whose tokens equal target only's. "host":
rltlab.bench.host's probes before the warm-up and after the last repeat (python loop, op
dispatch, read-back), to tell a slow host from a slow config. Last line: JSON.

    python -m rltlab.bench.tree_spec --device cuda --paths engine --trees-from PROBE.json \\
        --budgets 8 --engine-compile off on
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch
from tqdm.auto import tqdm

from rltlab.common.atomic import write_json_atomic
from rltlab.common.device import add_device_argument
from rltlab.draft_heads.selfdistill import draft_heads_dir
from rltlab.engine.config import ExecutionConfig
from rltlab.engine.spec.proposers import LOOKUP_RULES

# the shipped heads, found from any working directory (as the embedded model is)
HEADS = str(draft_heads_dir() / "lookahead_h4")
PIPELINE = ExecutionConfig.spec_pipeline   # rows at another spec_pipeline are named " P=<p>"


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def interleaved(configs: dict, repeats: int, device):
    """Run every config once a repeat, the order rotating each repeat -> yields (name, its
    result, seconds), each timed between device syncs (the bar and the rotation outside)."""
    names = list(configs)
    for rep in tqdm(range(repeats), desc="repeats", unit="repeat"):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            _sync(device)
            started = time.perf_counter()
            result = configs[name]()
            _sync(device)
            yield name, result, time.perf_counter() - started


def _paired(base_seconds: list[float], seconds: list[float]) -> dict:
    """Per-repeat time ratios base / config: median, mean, SE, range."""
    ratios = [b / t for b, t in zip(base_seconds, seconds)]
    return {"median": statistics.median(ratios), "mean": statistics.mean(ratios),
            "se": statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else 0.0,
            "range": [min(ratios), max(ratios)]}


def tau_by_kind(steps_emitted: list[tuple[int, int]], kinds: list[str]) -> tuple[float, dict]:
    """(steps, emitted tokens) per request and each request's prompt kind -> (tau over all
    requests, {kind: tau over that kind's})."""
    def tau(pairs):
        return sum(e for _, e in pairs) / max(sum(s for s, _ in pairs), 1)
    return tau(steps_emitted), {kind: tau([p for p, k in zip(steps_emitted, kinds) if k == kind])
                                for kind in sorted(set(kinds))}


FASTER = ("target only", "target only compiled", "target only early",
          "target only compiled early")


def _pairings(seconds: dict[str, list[float]], name: str, labels) -> dict:
    """Config `name`'s vs_faster (against the fastest of the target-only rows in FASTER,
    repeat by repeat, where more than one ran) and, for a name holding an --also-heads label,
    vs_heads (against the same config with --heads)."""
    out = {}
    baselines = [seconds[b] for b in FASTER if b in seconds]
    if len(baselines) > 1:
        out["vs_faster"] = _paired(list(map(min, *baselines)), seconds[name])
    for label in filter(None, labels):
        if label in name and name.replace(label, "") in seconds:
            out["vs_heads"] = _paired(seconds[name.replace(label, "")], seconds[name])
    return out


def _trees(args, artifact_tree) -> dict:
    trees = {"root only": [], "chain K=4": [tuple([0] * j) for j in range(1, 5)],
             f"artifact tree B={len(artifact_tree)}": artifact_tree}
    if args.trees_from:
        found = json.loads(Path(args.trees_from).read_text())
        found = found.get("result", found)["trees"]
        for b in args.budgets:
            key = f"tree B={b}"
            if key not in found:
                raise SystemExit(f"{args.trees_from} has no {key!r} (has {sorted(found)})")
            trees[key] = [tuple(p) for p in found[key]]
    only = getattr(args, "only", None)
    if only:
        if set(only) - set(trees):
            raise SystemExit(f"--only {sorted(set(only) - set(trees))}: no such tree "
                             f"(have {sorted(trees)})")
        trees = {name: tree for name, tree in trees.items() if name in only}
    return trees


def _engine_configs(args, model, trees, heads, max_len, params) -> dict:
    """One engine per (--engine-compile, --pipelines, --gemv-rows, --launch-early),
    holding a TreeProposer per tree and heads (their private blocks reserved beside one
    max_len sequence's) -> {name: generate function}. heads: {name suffix: LookaheadHeads},
    "" for --heads."""
    from rltlab.engine import LLM, TreeProposer
    from rltlab.model.speculative import SpecStats
    from rltlab.engine.spec.tree_graph import private_blocks
    bs = 16
    rule_names = {False: "", "hits": " adaptive", "agree": " agree"}
    proposers = {f"{name}{f' +lookup{n}' if n else ''}{rule_names[rule]}{' first' * first}"
                 f"{label}":
                 TreeProposer(drafter, tree, lookup=n, ngram=args.ngram,
                              adaptive_lookup=rule, first_drafts=first)
                 for label, drafter in heads.items()
                 for name, tree in trees.items() for n in args.lookup
                 for rule in [False] + (args.adaptive_lookup if n > 0 and tree else [])
                 for first in (False, True)[:1 + (args.first_drafts and bool(tree))]}
    private = sum(map(private_blocks, proposers.values()))
    configs = {}
    for compiled, pipeline, gemv, early in itertools.product(
            args.engine_compile, args.pipelines, args.gemv_rows,
            (False, True)[:1 + args.launch_early]):
        llm = LLM(model, max_num_seqs=1, block_size=bs, max_model_len=max_len,
                  spec_pipeline=pipeline,
                  num_blocks=-(-max_len // bs) + private,
                  decode_path="static", compile=compiled,   # static: auto's choice on CUDA
                  gemv_rows=gemv, launch_behind_prompt=early)
        suffix = (f" P={pipeline}" if pipeline != PIPELINE else "") + " compiled" * compiled + \
            (f" gemv<={gemv}" if gemv > 1 else "") + " early" * early
        for name, proposer in proposers.items():
            configs[f"engine {name}{suffix}"] = _engine_config(
                llm, proposer, params, SpecStats)
    return configs


def _engine_config(llm, proposer, params, stats_type):
    def go(prompts):
        llm.set_proposer(proposer)
        outs = llm.generate(prompts, params)
        go.stats = [stats_type(**{k: o.spec_stats[k] for k in
                                  ("steps", "drafted", "accepted", "emitted")})
                    if o.spec_stats else stats_type() for o in outs]
        return [list(o.outputs[0].token_ids) for o in outs]
    go.nodes = len(proposer.paths)
    return go


def run(args) -> dict:
    from rltlab.draft_heads import lookahead
    from rltlab.draft_heads.evaluate import eval_prompt_kinds, eval_prompts
    from rltlab.engine import LLM, SamplingParams
    from rltlab.model.tree_spec import TreeSpecGenerator
    from rltlab.model.checkpoint import load_model
    model, tok, md = load_model(args.model, dtype=args.dtype, device=args.device)
    model.eval()
    heads, artifact_tree, meta = lookahead.load(args.heads, model)
    drafters = {"": heads, **{f" heads={Path(d).name}": lookahead.load(d, model)[0]
                              for d in args.also_heads}}
    prompts = eval_prompts(tok, md, args.prompts)
    kinds = eval_prompt_kinds(args.prompts)
    max_len = max(map(len, prompts)) + args.max_tokens + 1
    llm = LLM(model, max_num_seqs=1, block_size=16, kv_cache_memory_gib=0.5,
              max_model_len=max_len)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, exit_policy="fixed")
    trees, gens = _trees(args, artifact_tree), {}
    for name, tree in trees.items() if "standalone" in args.paths else ():
        gens[name] = TreeSpecGenerator(model, heads, tree, max_len)
        if len(tree) in args.compile_nodes:
            gens[name + " compiled"] = TreeSpecGenerator(model, heads, tree, max_len,
                                                         compile=True)
    engines = (_engine_configs(args, model, trees, drafters, max_len, params)
               if "engine" in args.paths else {})

    def target_only(llm=llm):
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]

    def tree_config(name):
        def go():
            outs = [gens[name].generate(p, args.max_tokens, args.eos) for p in prompts]
            go.stats = [o.stats for o in outs]
            return [o.token_ids for o in outs]
        return go

    def baseline(**config):
        return partial(target_only, LLM(model, max_num_seqs=1, block_size=16,
                                        kv_cache_memory_gib=0.5, max_model_len=max_len,
                                        **config))
    baselines = {"target only compiled": baseline(compile=True)} \
        if True in args.engine_compile else {}
    if args.launch_early:   # token windows launched behind the prompt step too
        baselines["target only early"] = baseline(launch_behind_prompt=True)
        if True in args.engine_compile:
            baselines["target only compiled early"] = baseline(compile=True,
                                                               launch_behind_prompt=True)
    if args.round_step_prompts:
        baselines["target only (round-step prompts)"] = baseline(whole_prompt_steps=False)
    configs = {"target only": target_only, **baselines,
               **{name: tree_config(name) for name in gens},
               **{name: partial(go, prompts=prompts) for name, go in engines.items()}}
    from rltlab.bench.host import host_speed
    host = {"start": host_speed(args.device)}   # the host this run saw (rltlab.bench.host)
    failed = {}
    # warm-up: graph captures, compiles
    for name, fn in tqdm(list(configs.items()), desc="warm-up", unit="config"):
        try:
            fn()
        except Exception as err:   # one broken config must not cost the others' device time
            if name == "target only":
                raise
            failed[name] = f"{type(err).__name__}: {err}"
            print(f"{name}: FAILED {failed[name]}", flush=True)
            del configs[name]
    seconds = {name: [] for name in configs}
    tokens, stats = {}, {}
    names = list(configs)
    for name, result, elapsed in interleaved(configs, args.repeats, args.device):
        tokens[name] = result
        seconds[name].append(elapsed)
        fn = configs[name]
        stats[name] = getattr(getattr(fn, "func", fn), "stats", None)
    host["end"] = host_speed(args.device)
    base = tokens["target only"]
    rows = []
    for name in names:
        paired = _paired(seconds["target only"], seconds[name])
        nodes = (len(gens[name].paths) if name in gens else
                 engines[name].nodes if name in engines else None)
        row = {"config": name, "nodes": nodes,
               "tokens": sum(map(len, tokens[name])),
               "tok_s": sum(map(len, tokens[name])) / statistics.median(seconds[name]),
               "seconds_all": seconds[name], "paired_speedup": paired["median"],
               "paired_mean": paired["mean"], "paired_se": paired["se"],
               "paired_range": paired["range"],
               "identical": f"{sum(a == b for a, b in zip(tokens[name], base))}/{len(base)}"}
        if stats[name]:
            row["tau"], row["tau_by_kind"] = tau_by_kind(
                [(x.steps, x.emitted) for x in stats[name]], kinds)
        row.update(_pairings(seconds, name, drafters))
        rows.append(row)
    return {"model": str(md), "dtype": args.dtype, "heads": args.heads,
            "also_heads": args.also_heads, "failed": failed,
            "paths": args.paths, "pipelines": args.pipelines,
            "engine_compile": args.engine_compile,
            "gemv_rows": args.gemv_rows, "launch_early": args.launch_early,
            "heads_training": meta.get("training", {}).get("script"), "prompts": args.prompts,
            "max_tokens": args.max_tokens, "repeats": args.repeats, "host": host, "rows": rows}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m rltlab.bench.tree_spec",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model dir (default: the embedded model)")
    ap.add_argument("--heads", default=HEADS)
    add_device_argument(ap)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--eos", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--trees-from", default=None)
    ap.add_argument("--budgets", type=int, nargs="*", default=[8, 16, 32])
    ap.add_argument("--only", nargs="+", default=None,
                    help="run only these trees (names as in the table, e.g. 'chain K=4')")
    ap.add_argument("--paths", nargs="+", choices=["engine", "standalone"],
                    default=["engine", "standalone"])
    ap.add_argument("--pipelines", type=int, nargs="+", default=[PIPELINE],
                    help="ExecutionConfig.spec_pipeline values for the engine path (default: the "
                         "engine's)")
    ap.add_argument("--engine-compile", choices=["off", "on"], nargs="+", default=["off"],
                    help="ExecutionConfig.compile for the engine path's trees; 'on' also runs "
                         "'target only compiled'")
    ap.add_argument("--gemv-rows", type=int, nargs="+", default=[1],
                    help="ExecutionConfig.gemv_rows values for the engine path (1: one-row "
                         "rounds only; trees of up to G rows through the Triton GEMV path)")
    ap.add_argument("--lookup", type=int, nargs="+", default=[0],
                    help="engine path: also run each tree with a prompt-lookup chain of "
                         "these lengths (TreeProposer(lookup=L); 0: without, '+lookupL' rows)")
    ap.add_argument("--adaptive-lookup", nargs="*", choices=LOOKUP_RULES, default=None,
                    metavar="RULE",
                    help="also run each tree with a lookup chain as TreeProposer("
                         "adaptive_lookup=RULE) for each RULE (hits, the default: ' adaptive' "
                         "rows; agree: ' agree' rows)")
    ap.add_argument("--first-drafts", action="store_true",
                    help="also run each tree with TreeProposer(first_drafts=True) (' first' "
                         "rows: a request's first iteration drafted from token 0's state)")
    ap.add_argument("--launch-early", action="store_true",
                    help="engine path: also run every engine config with each request's first "
                         "program launched behind its prompt step (' early' rows, "
                         "ExecutionConfig.launch_behind_prompt)")
    ap.add_argument("--also-heads", nargs="+", default=[], metavar="DIR",
                    help="engine path: also run every engine config with these lookahead "
                         "heads (' heads=<DIR name>' rows)")
    ap.add_argument("--ngram", type=int, default=3,
                    help="the lookup chain's longest n-gram (TreeProposer(ngram=...))")
    ap.add_argument("--compile-nodes", type=int, nargs="*", default=[],
                    help="also run the standalone trees of these node counts under "
                         "torch.compile")
    ap.add_argument("--round-step-prompts", action="store_true",
                    help="also run target only with each prompt in R round steps "
                         "(ExecutionConfig.whole_prompt_steps=False)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.engine_compile = [c == "on" for c in args.engine_compile]
    # a bare --adaptive-lookup: the hits rule
    args.adaptive_lookup = ["hits"] if args.adaptive_lookup == [] else args.adaptive_lookup or []
    limits = {"--repeats >= 1": args.repeats >= 1, "--prompts >= 2": args.prompts >= 2,
              "--max-tokens >= 1": args.max_tokens >= 1,
              "--pipelines >= 1": min(args.pipelines) >= 1,
              "--gemv-rows in 1..64": all(1 <= g <= 64 for g in args.gemv_rows),
              "--lookup in 0..16 (the block size)": all(0 <= n <= 16 for n in args.lookup),
              "--ngram >= 1": args.ngram >= 1}
    broken = [limit for limit, holds in limits.items() if not holds]
    if broken:
        ap.error("needs " + ", ".join(broken))
    res = run(args)
    print("host (start / end): " + ", ".join(
        f"{k} {res['host']['start'][k]:.1f} / {res['host']['end'][k]:.1f}"
        for k in res["host"]["start"]))
    print(f"{'config':>38} | nodes | tok/s | paired (median, mean ± SE) | vs faster | tau | "
          "identical | vs --heads")
    for r in res["rows"]:
        extra = {key: f"{r[key]['median']:.3f} ({r[key]['mean']:.3f} ± {r[key]['se']:.3f})"
                 for key in ("vs_faster", "vs_heads") if key in r}
        print(f"{r['config']:>38} | {str(r['nodes']):>5} | {r['tok_s']:7.1f} | "
              f"{r['paired_speedup']:.3f} ({r['paired_mean']:.3f} ± {r['paired_se']:.3f}) | "
              f"{extra.get('vs_faster', '-')} | {r.get('tau', 1.0):.2f} | {r['identical']} | "
              f"{extra.get('vs_heads', '-')}")
    if args.out:
        write_json_atomic(args.out, res, indent=1)
    print(json.dumps({r["config"]: round(r["paired_speedup"], 3) for r in res["rows"]}))
    return res


if __name__ == "__main__":
    from rltlab.common.command import run_command

    run_command(main)
