"""Where a tree iteration's GPU time goes (rltlab.engine.tree_graph): the whole iteration (its
captured graph, as tree_graph_timing.py) against its rounds alone (the R static-decoder rounds
over the tree's rows, captured as a graph of their own on the same staged rows), so glue =
iteration - rounds: the indices, the prefix-block copies, the embedding, the LM head, the walk,
the commit and the heads. Then the glue's kernels: _prepare and _conclude run eagerly under
torch.profiler, their CUDA kernels counted and summed (device time), the costliest listed.

    python docs/experiments/scripts/tree_iteration_split.py --trees-from \\
        docs/experiments/data/2026-12-03-lookahead-tree-probe-h200.json --budgets 8 \\
        [--compile off on] [--only 'chain K=4']
"""
import argparse
import itertools
import json

import torch

from rltlab.bench.tree_spec import HEADS, _trees
from rltlab.draft_heads import lookahead
from rltlab.draft_heads.evaluate import eval_prompts
from rltlab.engine import LLM, SamplingParams, TreeProposer
from rltlab.engine.static_decode import capture_graph
from rltlab.engine.tree_graph import TreeShape, private_blocks
from rltlab.model.checkpoint import load_model


def _graph_ms(graph, replays: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def _glue_inputs(program):
    """(token, base, left, cap, valid, table, candidates, history) as _program reads them."""
    token, base, left, cap, valid = (program.index[i: i + 1] for i in range(5))
    at = program._history_at
    history = program.index[at:] if program.tree.proposer.lookup else None
    return token, base, left, cap, valid, program.index[5: at], program.tree.cand_in, history


def _prepare(program, token, base, left, cap, valid, table, cand, history):
    return program._prepare(token, base, left, cap, table, cand, history)


def _rounds_graph(program):
    """The iteration's R rounds over its rows, on the indices its _prepare makes now."""
    st, rows = program.static, program.tree.shape.num_rows
    x, *_, index, rope = _prepare(program, *_glue_inputs(program))

    def rounds():
        for r in range(st.config.num_rounds):
            st._round(rows, plane=r, rows=index, x=x if r == 0 else st.hidden_out[:rows],
                      rope=rope)
    return capture_graph(rounds, None)


def _glue_kernels(program, calls: int = 5) -> dict:
    """CUDA kernels of _prepare + _conclude per call (eager): count, device us, the top 8."""
    args = _glue_inputs(program)
    st, rows = program.static, program.tree.shape.num_rows
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            x, tokens, pos_p, first, live, _, _ = _prepare(program, *args)
            program._conclude(st.hidden_out[:rows], tokens, pos_p, first, live, *args[3:6],
                              args[7])
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name = {}
    for e in kernels:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.device_time / calls
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
    return {"kernels_per_iteration": len(kernels) / calls,
            "device_us_per_iteration": sum(by_name.values()),
            "top": [(name[:70], round(us, 2)) for name, us in top]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees-from", default=None)
    ap.add_argument("--budgets", type=int, nargs="*", default=[])
    ap.add_argument("--only", nargs="+", default=None, help="only these trees")
    ap.add_argument("--gemv-rows", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--compile", choices=["off", "on"], nargs="+", default=["off"],
                    help="EngineConfig.compile (on: the glue is torch.compile'd)")
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--lookup", type=int, default=0,
                    help="a prompt-lookup chain of this length beside every tree")
    args = ap.parse_args()
    model, tok, md = load_model(None, dtype="float32", device="cuda")
    heads, artifact_tree, _ = lookahead.load(HEADS, model)
    prompts = eval_prompts(tok, md, 4)
    max_len = max(map(len, prompts)) + 33
    params = SamplingParams(temperature=0.0, max_tokens=32, exit_policy="fixed")
    trees = _trees(args, artifact_tree)
    proposers = {name: TreeProposer(heads, t, lookup=args.lookup) for name, t in trees.items()}
    private = sum(map(private_blocks, proposers.values()))
    rows = []
    for compiled, gemv, (name, proposer) in itertools.product(args.compile, args.gemv_rows,
                                                              proposers.items()):
        llm = LLM(model, max_num_seqs=1, block_size=16, max_model_len=max_len,
                  num_blocks=-(-max_len // 16) + private, decode_path="static",
                  gemv_rows=gemv, compile=compiled == "on",
                  spec_pipeline=1)   # replayed over and over: a following program moves on
        llm.set_proposer(proposer)
        llm.generate(prompts[:2], params)
        program = llm.llm_engine._spec._tree._programs[1, False, True, False]
        iteration = _graph_ms(program._graph, args.replays)
        rounds = _graph_ms(_rounds_graph(program), args.replays)
        row = {"tree": name, "lookup": args.lookup, "gemv_rows": gemv, "compile": compiled,
               "rows": TreeShape(proposer.paths, "cpu").num_rows,
               "iteration_ms": iteration, "rounds_ms": rounds, "glue_ms": iteration - rounds,
               "glue_eager": _glue_kernels(program)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
