"""A request's tree programs looped on the device (CUDA graph WHILE / IF-ELSE nodes) against
TreeGraph.run's host loop, paired in one process (twenty-eighth session: a prototype, not in
the library; graph_while_probe.py showed the tree program runs inside a WHILE node).

TreeGraph.run reads each program back and launches the next from the host: 37-64 us of device
idle a program on the idle timelines. Here (`run_device_loop`, patched over TreeGraph.run in
"device loop" mode) the request's first program is launched as before, and right behind it
one graph (graph_while_probe.cu's build_tree_loop) that runs the rest:

  decide -> WHILE(go) { IF(rows) program with the lookup chain's rows ELSE without;
                        decide }

`decide` is a captured torch graph: it appends the last program's output row to a ring,
computes go (live, finite logits, tokens left, no stop token among the emitted tokens, fewer
than spec_pipeline programs so far) and rows (the proposer's rule: `hits` of the last row, as
TreeGraph.run's lookup_next), and copies the ring and its count to pinned host memory. The
host polls that count and handles each row as TreeGraph.run does, while the device goes on.
Off CUDA the same decide and programs run in a Python loop (the dry run checks the host
side and the decisions: the same tokens and spec_stats as the host loop).

The claim's 32 x 32 workload: target only early and target only compiled early (the
baselines), and the claimed tree config in both modes, interleaved, 11 repeats.

    python docs/experiments/scripts/device_loop_ab.py --device cuda
    python docs/experiments/scripts/device_loop_ab.py --device cpu --prompts 8 --repeats 1 \
        --spec-pipeline 3
The dry run's same_spec_stats was seen false with the next program's rows inverted in decide
and with one program past spec_pipeline (the tokens stay identical: the tree is lossless
whatever it verifies). Unrun on a GPU. Last line: JSON.
"""
import argparse
import ctypes
import json
import time

import torch

from from_ids_ab import paired
from graph_while_probe import KeptGraph, build_library
from rltlab.bench.tree_spec import HEADS
from rltlab.draft_heads import lookahead
from rltlab.draft_heads.evaluate import eval_prompts
from rltlab.engine import LLM, SamplingParams, TreeProposer
from rltlab.engine.tree_graph import TreeGraph, private_blocks
from rltlab.model.checkpoint import load_model

HOST_RUN = TreeGraph.run
MAX_STOPS = 8


class DeviceLoop:
    """The loop of one TreeGraph's programs (with and without the lookup chain's rows)."""

    def __init__(self, tree: TreeGraph, programs: dict, lib):
        lead = programs[True]
        dev, width = lead.out.device, lead.width
        self.tree, self.programs, self.lib, self.width = tree, programs, lib, width
        self.limit = torch.zeros(1, dtype=torch.long, device=dev)
        self.stops = torch.full((MAX_STOPS,), -1, dtype=torch.long, device=dev)
        self.count = torch.zeros(1, dtype=torch.long, device=dev)
        self.ring = torch.zeros(64, width, dtype=torch.long, device=dev)
        self.flags = torch.zeros(2, dtype=torch.int32, device=dev)
        pin = dev.type == "cuda"
        self.host_ring = torch.zeros(self.ring.shape, dtype=torch.long, pin_memory=pin)
        self.host_count = torch.zeros(1, dtype=torch.long, pin_memory=pin)
        self.exec, self._stop_rows = None, {}
        if pin:
            self._decide()                         # warm-up outside the capture
            self._decide_graph = KeptGraph()
            with torch.cuda.graph(self._decide_graph):
                self._decide()
            without = programs.get(False, lead)
            exec_ = ctypes.c_void_p()
            err = lib.build_tree_loop(lead._graph.raw_cuda_graph(),
                                      without._graph.raw_cuda_graph(),
                                      self._decide_graph.raw_cuda_graph(),
                                      self.flags.data_ptr(), ctypes.byref(exec_))
            if err:
                raise RuntimeError(lib.error_string(err).decode())
            self.exec = exec_

    def _decide(self) -> None:
        """The last program's output row into the ring; flags = [go on, next rows]."""
        lead, span = self.programs[True], self.tree.proposer.span
        out, left = lead.out[: self.width], lead.index[2:3]
        n, path, bonus = out[0], out[1: 1 + span], out[1 + span: 2 + span]
        finite, live, hits = out[2 + span], out[3 + span], out[4 + span]
        self.ring.index_copy_(0, self.count, out[None])
        self.count.add_(1)
        levels = torch.arange(span, device=out.device)
        stopped = (torch.isin(path, self.stops) & (levels < n)).any() | \
            torch.isin(bonus, self.stops).any()
        go = (live > 0) & (finite > 0) & (left[0] > 0) & ~stopped & (self.count[0] < self.limit[0])
        rows = (hits > 0) if self.tree.proposer.adaptive_lookup else torch.ones_like(go)
        self.flags.copy_(torch.stack([go, rows]).int())
        self.host_ring.copy_(self.ring, non_blocking=True)
        self.host_count.copy_(self.count, non_blocking=True)

    def launch(self, launches: int, stops: frozenset) -> None:
        """Right behind the request's first program: the loop over the rest."""
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop tokens")
        self.limit.fill_(launches)
        if stops not in self._stop_rows:   # on the device once per set: no host copy here
            row = sorted(stops) + [-1] * (MAX_STOPS - len(stops))
            self._stop_rows[stops] = torch.tensor(row, device=self.stops.device)
        self.stops.copy_(self._stop_rows[stops])
        self.count.zero_()
        self.host_count.zero_()
        if self.exec is not None:
            self.done = torch.cuda.Event()
            err = self.lib.launch(self.exec, torch.cuda.current_stream().cuda_stream)
            if err:
                raise RuntimeError(self.lib.error_string(err).decode())
            self.done.record()
            return
        self._decide()                              # the CPU: the same steps, eagerly
        while int(self.flags[0]):
            self.programs[bool(self.flags[1])]._program()
            self._decide()

    def row(self, i: int) -> list[int]:
        """Output row i, waiting (polling pinned memory) until the device has written it."""
        while int(self.host_count[0]) <= i:
            if self.exec is not None and self.done.query() and int(self.host_count[0]) <= i:
                raise RuntimeError(f"the device loop ended before program {i}")
        return self.host_ring[i].tolist()


def run_device_loop(self, seq, chain, launches=1, stops=frozenset()):
    """TreeGraph.run with the programs after the first looped on the device (chain 1)."""
    if chain != 1 or launches < 2 or any(p._graph is None and p.static.cuda_graphs
                                         for p in self._programs.values()):
        yield from HOST_RUN(self, seq, chain, launches, stops)
        return
    start, left = seq.num_tokens - 1, seq.max_output_tokens - seq.num_output_tokens
    early, self._early = self._early, None
    if early is not None and early[0] == self._early_key(seq, start, chain, True):
        programs, program, cap, valid, lookup = early[1]
    else:
        fresh = self.drafted_for != (seq.seq_id, start)
        emitted = seq.emit_hidden
        first = fresh and self.proposer.first_drafts and emitted is not None and \
            emitted[0] == seq.num_output_tokens - 1
        programs, program, cap, valid, lookup = self._start(
            seq, chain, True, start, left, fresh, emitted[1] if first else None,
            seq.output_token_ids[-1])
    loops = self.__dict__.setdefault("_device_loops", {})
    key = (id(self._static), tuple(id(p) for p in programs.values()))
    if key not in loops:
        try:
            loops[key] = DeviceLoop(self, programs, LIB)
        except RuntimeError as exc:   # e.g. a node type the driver refuses: the host loop
            LOOP_ERRORS.append(f"{type(exc).__name__}: {exc}")
            loops[key] = None
    loop = loops[key]
    if loop is None:
        current = [program]

        def relaunch(lookup):
            current[0] = programs[lookup]
            current[0].launch()
        yield from _results(self, seq, lambda _: current[0].read(), relaunch, cap, valid,
                            lookup, launches, stops)
        return
    LOOP_RUNS.append(1)
    loop.launch(launches, stops)
    yield from _results(self, seq, loop.row, lambda lookup: None, cap, valid, lookup, launches,
                        stops)


def _results(self, seq, row, relaunch, cap, valid, lookup, launches, stops):
    """TreeGraph.run's handling of each program's output row (chain 1), from the first
    program on: row(i) reads program i's; relaunch(lookup) launches the next one where the
    host does (the device loop needs none)."""
    start, left = seq.num_tokens - 1, seq.max_output_tokens - seq.num_output_tokens
    depth, position, adaptive = self.proposer.span, start, self.proposer.adaptive_lookup
    for launch in range(launches):
        n, *path, bonus, finite, live, hits = row(launch)
        if not live:
            yield None
            return
        verified = self._heads_within[cap] * valid + min(self.proposer.lookup, cap) * lookup
        position, left = position + n + 1, left - n - 1
        cap, valid = max(0, min(depth, left - 1)), True
        goes_on = launch + 1 < launches and bool(finite) and left > 0 and \
            stops.isdisjoint(path[:n] + [bonus])
        self.drafted_for, self.lookup_next = (seq.seq_id, position), hits > 0
        lookup = not adaptive or self.lookup_next
        if goes_on:
            relaunch(lookup)
        yield path[:n], bonus, bool(finite), verified
        if not goes_on:
            return


LIB, LOOP_ERRORS, LOOP_RUNS = None, [], []


def main():
    global LIB
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--spec-pipeline", type=int, default=None,
                    help="EngineConfig.spec_pipeline of the tree engine (default: the engine's)")
    args = ap.parse_args()
    if args.prompts < 1 or args.repeats < 1:
        ap.error("--prompts and --repeats must be >= 1")
    if args.device == "cuda":
        LIB = build_library("sm_90")
        LIB.build_tree_loop.argtypes = [ctypes.c_void_p] * 4 + [ctypes.POINTER(ctypes.c_void_p)]
        torch.cuda.CUDAGraph = KeptGraph          # the programs' graphs stay available
    model, tok, md = load_model(None, dtype="float32", device=args.device)
    heads, _, _ = lookahead.load(HEADS, model)
    prompts = eval_prompts(tok, md, args.prompts)
    max_len = max(map(len, prompts)) + args.max_tokens + 1
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, exit_policy="fixed")
    proposer = TreeProposer(heads, [(0,) * d for d in range(1, heads.depth + 1)], lookup=10,
                            adaptive_lookup="agree", first_drafts=True)
    common = dict(max_num_seqs=1, block_size=16, max_model_len=max_len,
                  launch_behind_prompt=True)
    compiled = args.device == "cuda"
    engines = {"target only early": LLM(model, **common),
               "target only compiled early": LLM(model, compile=compiled, **common),
               "tree": LLM(model, num_blocks=-(-max_len // 16) + private_blocks(proposer),
                           decode_path="static", gemv_rows=64, compile=compiled, **common,
                           **({"spec_pipeline": args.spec_pipeline} if args.spec_pipeline
                              else {}))}
    engines["tree"].set_proposer(proposer)
    runs = [("target only early", "host loop"), ("target only compiled early", "host loop"),
            ("tree", "host loop"), ("tree", "device loop")]
    modes = {"host loop": HOST_RUN, "device loop": run_device_loop}
    seconds, outputs, stats = {r: [] for r in runs}, {}, {}
    for name, mode in runs + runs:              # warm-up: compiles, captures, the loop's build
        TreeGraph.run = modes[mode]
        engines[name].generate(prompts, params)
    for repeat in range(args.repeats):
        for name, mode in runs[repeat % len(runs):] + runs[:repeat % len(runs)]:
            TreeGraph.run = modes[mode]
            if args.device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            outs = engines[name].generate(prompts, params)
            if args.device == "cuda":
                torch.cuda.synchronize()
            seconds[name, mode].append(time.perf_counter() - started)
            outputs[name, mode] = [o.outputs[0].token_ids for o in outs]
            stats[name, mode] = [dict(o.spec_stats) if o.spec_stats else {} for o in outs]
    TreeGraph.run = HOST_RUN
    reference = outputs["target only early", "host loop"]
    result = {"device": args.device, "prompts": args.prompts, "max_tokens": args.max_tokens,
              "repeats": args.repeats,
              "identical": {f"{n} ({m})": sum(a == b for a, b in zip(outputs[n, m], reference))
                            for n, m in runs},
              "same_spec_stats": stats["tree", "host loop"] == stats["tree", "device loop"],
              "device_loop_steps": len(LOOP_RUNS), "device_loop_errors": LOOP_ERRORS,
              "host_over_device_loop": paired([h / d for h, d in zip(
                  seconds["tree", "host loop"], seconds["tree", "device loop"])]),
              "tree_vs_fastest_target": {}, "seconds": {f"{n} ({m})": s
                                                        for (n, m), s in seconds.items()}}
    fastest = list(map(min, seconds[runs[0]], seconds[runs[1]]))
    for mode in modes:
        result["tree_vs_fastest_target"][mode] = paired(
            [f / t for f, t in zip(fastest, seconds["tree", mode])])
    for key in ("identical", "same_spec_stats", "device_loop_steps", "device_loop_errors",
                "host_over_device_loop", "tree_vs_fastest_target"):
        print(key, json.dumps(result[key]), flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
