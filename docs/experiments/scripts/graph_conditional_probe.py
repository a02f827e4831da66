"""Can this torch capture data-dependent control flow in one CUDA graph (conditional IF and
WHILE nodes, CUDA 12.4+)? The twenty-seventh session's lead for issue 16: a tree program that
loops on the device until its sequence ends, choosing the lookup chain's rows by the proposer's
rule there, would remove the host's read-back and relaunch between programs (~54 us each, 5% of
the tree's span on an H100 start, docs/benchmarks/2026-12-05-s27-h100.md) without the dropped
program that launching one ahead cost (docs/benchmarks/2026-12-04-s20-h200.md, call 3).

Each probe captures a small function into a torch.cuda.CUDAGraph, replays it with the
condition set both ways on the device, and compares with the same function run eagerly:
  cond:        torch.cond(flag, x + 1, x - 1)
  while_loop:  torch._higher_order_ops.while_loop(i < n, (i + 1, x * 2)), n on the device
and reports what it raised where it did not work (a capture that needs a host sync raises), with
the error inside the capture. On CUDA also torch.cond under torch.compile(backend="eager"), and
the graph API's conditional-node methods where this torch has any. On the CPU only the eager
runs are checked (no capture).

On the H100 image of the twenty-seventh session (torch 2.11.0+cu130) both plain captures
failed (cudaErrorStreamCaptureInvalidated at capture_end).

    python docs/experiments/scripts/graph_conditional_probe.py --device cuda
Last line: JSON.
"""
import argparse
import json
import traceback

import torch


def _capture(fn, *args):
    """fn(*args) captured as a CUDA graph (after a warm-up run on a side stream) -> (graph,
    its outputs, which each replay rewrites)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph, inner = torch.cuda.CUDAGraph(), None
    try:
        with torch.cuda.graph(graph):
            try:
                out = fn(*args)
            except Exception as err:   # what broke the capture (capture_end's error hides it)
                inner = err
                raise
    except Exception as err:
        raise RuntimeError(f"inside the capture: {type(inner).__name__}: {inner}"[:500]
                           if inner is not None else str(err)[:500]) from err
    return graph, out


def probe_cond(device: str, compiled: bool = False) -> dict:
    def fn(flag, x):
        return torch.cond(flag, lambda v: v + 1, lambda v: v - 1, (x,))
    if compiled:
        fn = torch.compile(fn, backend="eager", fullgraph=True)
    flag = torch.ones((), dtype=torch.bool, device=device)
    x = torch.arange(4, dtype=torch.float32, device=device)
    eager = {b: fn(torch.tensor(b, device=device), x).tolist() for b in (True, False)}
    if device != "cuda":
        return {"eager": eager}
    graph, out = _capture(fn, flag, x)
    replayed = {}
    for b in (True, False):
        flag.fill_(b)
        graph.replay()
        replayed[b] = out.tolist()
    return {"eager": eager, "replayed": replayed, "same": replayed == eager}


def probe_while(device: str) -> dict:
    from torch._higher_order_ops import while_loop

    def fn(n, x):
        i = torch.zeros((), dtype=torch.int64, device=device)
        return while_loop(lambda i, v: i < n, lambda i, v: (i + 1, v * 2), (i, x))
    x = torch.ones(4, dtype=torch.float32, device=device)
    counts = (3, 5)
    eager = {c: fn(torch.tensor(c, device=device), x)[1].tolist() for c in counts}
    if device != "cuda":
        return {"eager": eager}
    n = torch.tensor(counts[0], device=device)
    graph, out = _capture(fn, n, x)
    replayed = {}
    for c in counts:
        n.fill_(c)
        graph.replay()
        replayed[c] = out[1].tolist()
    return {"eager": eager, "replayed": replayed, "same": replayed == eager}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    report = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": args.device,
              # the graph API's conditional / child-node methods, where this torch has any
              "graph_methods": sorted(m for m in dir(torch.cuda.CUDAGraph)
                                      if any(w in m for w in ("cond", "if_", "while", "child")))}
    probes = [("cond", probe_cond), ("while_loop", probe_while)]
    if args.device == "cuda":   # the same under torch.compile's eager backend (PR 168912)
        probes += [("cond compiled", lambda d: probe_cond(d, compiled=True))]
    for name, probe in probes:
        try:
            report[name] = probe(args.device)
        except Exception as err:   # the finding: what this torch refuses, and where
            report[name] = {"error": f"{type(err).__name__}: {err}"[:600],
                            "where": traceback.format_exc(limit=-3)[-900:]}
        print(name, json.dumps(report[name], default=str), flush=True)
    print(json.dumps(report, default=str))


if __name__ == "__main__":
    main()
