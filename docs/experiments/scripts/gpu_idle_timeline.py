"""Where the device idles in c = 1 decoding, by what it waits for: target only against the tree
config of issue 16's claim, on the held-out prompts (greedy, 32 new tokens by default).

Every host call that queues device work is wrapped by a timing event on the stream before and
after it (CUDA events; on the CPU, where every op runs at once, host clocks; a wrapped call
inside another is not marked apart):
  inputs      whole_prompt_inputs        a whole-prompt step's token ids, positions, slots and
                                         embeddings
  rounds      PrefillGraphs._run / FusedPrefill.run_rounds   its R rounds (a graph replay where
                                         prefill graphs run)
  from ids    PrefillGraphs.run_from_ids a whole-prompt step built from token ids into its
                                         captured bucket, and its replay
  token 0     ModelRunner.greedy         token 0's argmax and finite flags
  stage       TreeProgram.stage / stage_token   a first program's inputs
  program     TreeProgram.launch         a tree program (one graph replay)
  window      TokenWindow._launch        target only's token window (CUDA)
  token step  FusedTokenStep.step        a whole-token step, its read-back included (where no
                                         window runs: target only on the CPU)
On one stream the events complete in the order they were queued, so the time between one item's
end and the next one's start is device time in which nothing wrapped ran: the device waited for
the host (or ran something unwrapped: a read-back's copy of a few bytes). The script sums those
gaps by transition ("program -> inputs" is the turn between one request's last program and the
next request's prompt step; "program -> program" the read-back and relaunch between programs)
and each item's own span, per config, over one warmed-up pass. The events cost a few us of
host time each, on every config alike.

    python docs/experiments/scripts/gpu_idle_timeline.py --device cuda
    python docs/experiments/scripts/gpu_idle_timeline.py --device cpu --prompts 4 --max-tokens 8

Last line: JSON.
"""
import argparse
import functools
import json
import time
from collections import defaultdict

import torch

from rltlab.bench.tree_spec import HEADS
from rltlab.draft_heads import lookahead
from rltlab.draft_heads.evaluate import eval_prompts
from rltlab.engine import LLM, SamplingParams, TreeProposer
from rltlab.engine import (fused_prefill, model_runner, prefill_graphs, token_step,
                           token_window, tree_program)
from rltlab.engine.tree_graph import private_blocks
from rltlab.model.checkpoint import load_model

WRAPPED = [(model_runner, "whole_prompt_inputs", "inputs"),
           (prefill_graphs.PrefillGraphs, "_run", "rounds"),
           (fused_prefill.FusedPrefill, "run_rounds", "rounds"),
           (prefill_graphs.PrefillGraphs, "run_from_ids", "from ids"),
           (model_runner.ModelRunner, "greedy", "token 0"),
           (tree_program.TreeProgram, "stage", "stage"),
           (tree_program.TreeProgram, "stage_token", "stage"),
           (tree_program.TreeProgram, "launch", "program"),
           (token_window.TokenWindow, "_launch", "window"),
           (token_step.FusedTokenStep, "step", "token step")]


class Marks:
    """(kind, start mark, end mark) per wrapped call while `on`; a mark is a CUDA event on the
    current stream, or a host clock reading off CUDA."""

    def __init__(self, cuda: bool):
        self.cuda, self.on, self.items = cuda, False, []
        self._inside = 0   # wrapped calls under way: only the outermost is marked

    def mark(self):
        if not self.cuda:
            return time.perf_counter() * 1e3
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def wrap(self, owner, name: str, kind: str) -> None:
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def wrapper(*args, **kwargs):
            if not self.on or self._inside:
                return inner(*args, **kwargs)
            self._inside += 1
            start = self.mark()
            try:
                return inner(*args, **kwargs)
            finally:
                self.items.append((kind, start, self.mark()))
                self._inside -= 1
        setattr(owner, name, wrapper)

    def timeline(self) -> list[tuple[str, float, float]]:
        """The items as (kind, start ms, end ms) from the first item's start."""
        if not self.items:
            return []
        if not self.cuda:
            base = self.items[0][1]
            return [(k, s - base, e - base) for k, s, e in self.items]
        torch.cuda.synchronize()
        first = self.items[0][1]
        return [(k, first.elapsed_time(s), first.elapsed_time(e)) for k, s, e in self.items]


def idle_by_transition(timeline: list[tuple[str, float, float]]) -> dict:
    """-> {"busy": {kind: ms}, "idle": {"a -> b": ms}, "gaps": {"a -> b": count}, "span": ms}:
    each item's own span by kind, and the time between an item's end and the next one's start
    (never negative: events complete in queue order) by the pair of kinds; span: the first start
    to the last end."""
    busy, idle, gaps = defaultdict(float), defaultdict(float), defaultdict(int)
    for i, (kind, start, end) in enumerate(timeline):
        busy[kind] += end - start
        if i:
            last_kind, _, last_end = timeline[i - 1]
            key = f"{last_kind} -> {kind}"
            idle[key] += max(0.0, start - last_end)
            gaps[key] += 1
    span = timeline[-1][2] - timeline[0][1] if timeline else 0.0
    return {"busy": dict(busy), "idle": dict(idle), "gaps": dict(gaps), "span": span}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--gemv-rows", type=int, default=64)
    ap.add_argument("--lookup", type=int, default=10)
    ap.add_argument("--heads", default=HEADS)
    ap.add_argument("--no-compile", action="store_true",
                    help="neither the tree engine nor a second target-only engine compiled")
    args = ap.parse_args()
    if args.prompts < 1:
        ap.error("--prompts must be >= 1")
    model, tok, md = load_model(None, dtype="float32", device=args.device)
    heads, tree, _ = lookahead.load(args.heads, model)
    prompts = eval_prompts(tok, md, args.prompts)
    max_len = max(map(len, prompts)) + args.max_tokens + 1
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, exit_policy="fixed")
    chain = [(0,) * d for d in range(1, heads.depth + 1)]   # bench.tree_spec's chain K
    proposer = TreeProposer(heads, chain, lookup=args.lookup, adaptive_lookup="agree",
                            first_drafts=True)
    common = dict(max_num_seqs=1, block_size=16, max_model_len=max_len,
                  launch_behind_prompt=True)
    compiled = not args.no_compile
    configs = [("target only early", LLM(model, **common), None)]
    if compiled:
        configs.append(("target only compiled early", LLM(model, compile=True, **common), None))
    configs.append((f"chain K={heads.depth} +lookup{args.lookup} agree first early",
                    LLM(model, num_blocks=-(-max_len // 16) + private_blocks(proposer),
                        decode_path="static", gemv_rows=args.gemv_rows, compile=compiled,
                        **common), proposer))
    marks = Marks(args.device == "cuda")
    for owner, name, kind in WRAPPED:
        marks.wrap(owner, name, kind)
    result, outputs = {}, {}
    for name, llm, prop in configs:
        llm.set_proposer(prop)
        llm.generate(prompts, params)              # warm-up: captures, compiles
        marks.items, marks.on = [], True
        started = time.perf_counter()
        outs = llm.generate(prompts, params)
        if args.device == "cuda":
            torch.cuda.synchronize()
        wall = 1e3 * (time.perf_counter() - started)
        marks.on = False
        row = idle_by_transition(marks.timeline())
        row["wall_ms"] = wall
        row["idle_share"] = sum(row["idle"].values()) / row["span"] if row["span"] else 0.0
        outputs[name] = [o.outputs[0].token_ids for o in outs]
        row["identical"] = sum(a == b for a, b in zip(outputs[name], outputs[configs[0][0]]))
        result[name] = row
        print(name, json.dumps(row), flush=True)
    print(json.dumps({"prompts": args.prompts, "max_tokens": args.max_tokens,
                      "device": args.device, "configs": result}))


if __name__ == "__main__":
    main()
