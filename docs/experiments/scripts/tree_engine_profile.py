"""Where the wall time of the engine's tree decoding goes, against target-only decoding, on the
s14/s15 workload (the held-out prompts, 32 new tokens, c = 1, greedy): host timers around
LLMEngine.step, the speculative step, the program's launch and its read-back (which waits for
the program, so it holds the GPU time the host did not overlap), token windows, whole-token
steps and the runner's execute (prefill), for target-only and for each tree at spec_chain 1.
--gemv-rows / --compile build the tree engine (and a second target-only engine, with
--compile) as EngineConfig.gemv_rows / .compile; --trees-from / --budgets / --only pick the
trees as in rltlab.bench.tree_spec;
--lookup L also runs each tree with a prompt-lookup chain of L (TreeProposer(lookup=L)),
with --adaptive-lookup verified only after a lookup hit (adaptive_lookup=True), or with
--adaptive-lookup agree where its next draft agrees with the heads' (adaptive_lookup="agree");
--first-drafts drafts each request's first iteration from token 0's state
(TreeProposer(first_drafts=True)); --launch-early builds every engine with
EngineConfig.launch_behind_prompt (a lone request's first program or token window queued
behind its prompt step) and times those launches.
--pipeline P builds the tree engine with EngineConfig.spec_pipeline = P (up to P programs a
step, each launched while the host handles the last one's tokens; default: the engine's).
--prompt-steps whole rounds runs every config with EngineConfig.whole_prompt_steps on (fresh
prompts' R rounds in one step, rltlab.engine.prompt_step) and off (R round steps; names end
in " (round-step prompts)"); "whole prompt step" times those steps.
--host-detail also times the host's turn between requests piece by piece (finishing a request,
building its output, scheduling, the prompt step's inputs and pinned copies, the prefill
bucket, token 0's argmax, the tree's first staging) and reports each timer's mean per call
("us_per_call"); the timers nest, and each adds ~1 us of its own.

    python docs/experiments/scripts/tree_engine_profile.py --device cuda
    python docs/experiments/scripts/tree_engine_profile.py --device cuda --gemv-rows 64 \
        --compile --trees-from docs/experiments/data/2026-12-03-lookahead-tree-probe-h200.json \
        --budgets 8 --only "chain K=4" "tree B=8" --prompts 16 --max-tokens 128
    python docs/experiments/scripts/tree_engine_profile.py --device cuda --gemv-rows 64 \
        --compile --budgets --only "chain K=4" --lookup 10 --adaptive-lookup agree \
        --first-drafts --launch-early --host-detail
"""
import argparse
import json
import time
from collections import defaultdict

import torch

from rltlab.bench.tree_spec import HEADS, _trees
from rltlab.draft_heads import lookahead
from rltlab.draft_heads.evaluate import eval_prompts
from rltlab.engine import LLM, SamplingParams, TreeProposer
from rltlab.engine import (fused_prefill, llm_engine, model_runner, prefill_graphs,
                           prompt_step, scheduler, spec_decode, token_step, token_window)
from rltlab.engine import tree_graph, tree_program
from rltlab.engine.config import EngineConfig
from rltlab.engine.hooks import LOOKUP_RULES
from rltlab.engine.tree_graph import private_blocks
from rltlab.model.checkpoint import load_model

TIMES: dict = defaultdict(float)
COUNTS: dict = defaultdict(int)


# --host-detail: the host's turn between two requests (the device idles through it)
HOST_DETAIL = [(llm_engine.LLMEngine, "_finish", "finish a request"),
               (llm_engine, "build_output", "build a request's output"),
               (spec_decode.SpecDecoder, "_emit", "emit a program's tokens"),
               (scheduler.Scheduler, "schedule", "schedule"),
               (model_runner, "whole_prompt_inputs", "prompt inputs"),
               (fused_prefill, "tensor_to_device", "prompt inputs' pinned copy"),
               (prefill_graphs.PrefillGraphs, "_run", "prefill bucket (prep + replay)"),
               (prefill_graphs.PrefillGraphs, "run_from_ids",
                "prompt step from token ids (prep + replay)"),
               (prefill_graphs, "tensor_to_device", "prefill bucket's pinned copy"),
               (model_runner.ModelRunner, "greedy", "token 0's argmax"),
               (llm_engine.LLMEngine, "_sample", "token 0 (sample, read back, early launch)"),
               (tree_graph.TreeGraph, "_start", "tree's first staging and launch")]


def timed(owner, name: str, key: str) -> None:
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            TIMES[key] += time.perf_counter() - started
            COUNTS[key] += 1
    setattr(owner, name, wrapper)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--gemv-rows", type=int, default=1)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--pipeline", type=int, default=EngineConfig.spec_pipeline)
    ap.add_argument("--adaptive-lookup", nargs="?", const="hits", default=False,
                    choices=LOOKUP_RULES,
                    help="the lookup proposers with TreeProposer(adaptive_lookup=RULE)")
    ap.add_argument("--first-drafts", action="store_true")
    ap.add_argument("--launch-early", action="store_true",
                    help="every engine with EngineConfig.launch_behind_prompt")
    ap.add_argument("--trees-from", default=None)
    ap.add_argument("--budgets", type=int, nargs="*", default=[])
    ap.add_argument("--only", nargs="+", default=None)
    ap.add_argument("--lookup", type=int, nargs="+", default=[0])
    ap.add_argument("--prompt-steps", nargs="+", choices=["whole", "rounds"], default=["whole"])
    ap.add_argument("--host-detail", action="store_true",
                    help="also time the host's turn between requests piece by piece")
    args = ap.parse_args()
    model, tok, md = load_model(None, dtype="float32", device=args.device)
    heads, tree, _ = lookahead.load(HEADS, model)
    prompts = eval_prompts(tok, md, args.prompts)
    max_len = max(map(len, prompts)) + args.max_tokens + 1
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, exit_policy="fixed")
    timed(llm_engine.LLMEngine, "step", "engine step")
    timed(spec_decode.SpecDecoder, "step", "tree step")
    timed(tree_program.TreeProgram, "launch", "program launch")
    timed(tree_program.TreeProgram, "read", "program read-back (waits for the GPU)")
    timed(tree_program.TreeProgram, "stage", "program stage")
    timed(token_window.TokenWindow, "step", "token window step")
    timed(token_step.FusedTokenStep, "step", "whole-token step")
    timed(model_runner.ModelRunner, "execute", "runner execute (prefill, round steps)")
    timed(prompt_step.WholePrompts, "step", "whole prompt step")
    timed(tree_graph.TreeGraph, "launch_first", "early program launch")
    timed(token_window.TokenWindow, "launch_first", "early window launch")
    if args.host_detail:
        for owner, name, key in HOST_DETAIL:
            timed(owner, name, key)
    trees = _trees(args, tree)   # root, chain, the artifact's (and --trees-from's), --only
    proposers = {f"{name}{f' +lookup{n}' if n else ''}"
                 f"{f' {args.adaptive_lookup}' if adaptive else ''}"
                 f"{' first' if args.first_drafts else ''}":
                 TreeProposer(heads, t, lookup=n, adaptive_lookup=adaptive,
                              first_drafts=args.first_drafts)
                 for name, t in trees.items() for n in args.lookup
                 for adaptive in [args.adaptive_lookup if n > 0 and t else False]}
    early = {"launch_behind_prompt": args.launch_early}
    private = sum(map(private_blocks, proposers.values()))
    configs = []
    for mode in args.prompt_steps:
        whole, suffix = mode == "whole", "" if mode == "whole" else " (round-step prompts)"
        base = LLM(model, max_num_seqs=1, block_size=16, max_model_len=max_len,
                   whole_prompt_steps=whole, **early)
        engine = LLM(model, max_num_seqs=1, block_size=16, max_model_len=max_len,
                     num_blocks=-(-max_len // 16) + private, decode_path="static",
                     gemv_rows=args.gemv_rows, compile=args.compile, whole_prompt_steps=whole,
                     spec_pipeline=args.pipeline, **early)
        configs += [("target only" + suffix, base, None)] + [
            ("target only compiled" + suffix,
             LLM(model, max_num_seqs=1, block_size=16, max_model_len=max_len, compile=True,
                 whole_prompt_steps=whole, **early), None)] * args.compile
        configs += [(name + suffix, engine, proposer) for name, proposer in proposers.items()]
    result = {}
    for name, llm, proposer in configs:
        llm.set_proposer(proposer)
        llm.generate(prompts, params)        # warm-up: graph captures
        TIMES.clear()
        COUNTS.clear()
        if args.device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        outs = llm.generate(prompts, params)
        if args.device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - started
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        row = {"wall_ms": 1e3 * wall, "tokens": tokens,
               "ms_per_token": 1e3 * wall / tokens,
               "ms": {k: 1e3 * v for k, v in TIMES.items()}, "calls": dict(COUNTS),
               "us_per_call": {k: 1e6 * v / COUNTS[k] for k, v in TIMES.items()}}
        result[name] = row
        print(name, json.dumps(row), flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
