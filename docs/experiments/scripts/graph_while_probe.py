"""Can a CUDA graph WHILE node run the tree program's graph, and what does it save per program?
(twenty-eighth session; the device-side loop of docs/benchmarks/2026-12-05-s27-h100.md).

torch 2.11 cannot capture a conditional node (graph_conditional_probe.py), but it can hand out
a captured graph (CUDAGraph(keep_graph=True).raw_cuda_graph()). graph_while_probe.cu, built
here with nvcc, wraps such graphs as child nodes of a WHILE node whose condition a one-thread
kernel sets from device memory (counter < limit): the host launches once for any number of
iterations.

  A  body = a torch graph that adds 1 to a counter (and a little work): the loop must run
     `limit` times for each limit written to the device (no rebuild), and once for limit 0
     (the first pass always runs). Per iteration: the WHILE loop against a host loop of
     replay + read-back (the engine's pattern) and against replays without read-backs.
  B  body = the claimed config's tree program (rltlab.engine.tree_program, captured by the
     engine with keep_graph), then the counter: accepted inside a conditional body at all
     (Triton kernels with PDL, inductor kernels, copies)? From the same state, N iterations
     by the WHILE loop and by the host loop (launch + read, as TreeGraph.run) must leave the
     same program output and inputs; per-iteration times as in A.

    python docs/experiments/scripts/graph_while_probe.py --device cuda [--iterations 64]
Last line: JSON. CUDA only.
"""
import argparse
import ctypes
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

SOURCE = Path(__file__).with_suffix(".cu")


class KeptGraph(torch.cuda.CUDAGraph):
    """A CUDAGraph that keeps its cudaGraph_t (raw_cuda_graph) and is instantiated at once."""

    def __new__(cls, keep_graph=True):
        return super().__new__(cls, keep_graph)

    def __init__(self, keep_graph=True):   # the base class reads keep_graph in either
        super().__init__(keep_graph)

    def capture_end(self):
        super().capture_end()
        if hasattr(self, "instantiate"):   # else replay() instantiates it
            self.instantiate()


def build_library(arch: str) -> ctypes.CDLL:
    out = Path(tempfile.mkdtemp()) / "libgraph_while.so"
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    subprocess.run([nvcc, "-O2", "-shared", "-Xcompiler", "-fPIC", "-cudart", "shared",
                    f"-arch={arch}", str(SOURCE), "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    lib.build_while.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                                ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.POINTER(ctypes.c_void_p)]
    lib.launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.error_string.restype = ctypes.c_char_p
    return lib


class WhileLoop:
    def __init__(self, lib, bodies: list, counter: torch.Tensor, limit: torch.Tensor):
        self.lib, self.bodies = lib, bodies          # the graphs must outlive the loop
        graphs = (ctypes.c_void_p * len(bodies))(*[g.raw_cuda_graph() for g in bodies])
        self.exec = ctypes.c_void_p()
        self._check(lib.build_while(graphs, len(bodies), counter.data_ptr(), limit.data_ptr(),
                                    ctypes.byref(self.exec)))

    def _check(self, err: int) -> None:
        if err:
            raise RuntimeError(self.lib.error_string(err).decode())

    def launch(self) -> None:
        self._check(self.lib.launch(self.exec, torch.cuda.current_stream().cuda_stream))


def seconds(fn, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return best


def part_a(lib, n: int) -> dict:
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    limit = torch.full((1,), n, dtype=torch.int64, device="cuda")
    work = torch.randn(4096, device="cuda")
    for _ in range(2):
        counter.add_(1), work.mul_(1.0001)
    body = KeptGraph()
    with torch.cuda.graph(body):
        counter.add_(1)
        work.mul_(1.0001)
    loop = WhileLoop(lib, [body], counter, limit)
    counts = {}
    for want in (n, 7, 0):
        limit.fill_(want)
        counter.zero_()
        loop.launch()
        counts[want] = int(counter.item())
    limit.fill_(n)

    def host_loop():
        for _ in range(n):
            body.replay()
            counter.item()

    def replays():
        for _ in range(n):
            body.replay()

    def device_loop():
        counter.zero_()
        loop.launch()
    times = {"host loop (replay + read-back)": seconds(host_loop) / n,
             "replays, no read-back": seconds(replays) / n,
             "while loop": seconds(device_loop) / n}
    return {"iterations_by_limit": counts, "us_per_iteration": {k: round(v * 1e6, 2)
                                                                 for k, v in times.items()}}


def part_b(lib, n: int) -> dict:
    from rltlab.bench.tree_spec import HEADS
    from rltlab.draft_heads import lookahead
    from rltlab.draft_heads.evaluate import eval_prompts
    from rltlab.engine import LLM, SamplingParams, TreeProposer, tree_program
    from rltlab.engine.tree_graph import private_blocks
    from rltlab.model.checkpoint import load_model
    model, tok, md = load_model(None, dtype="float32", device="cuda")
    heads, _, _ = lookahead.load(HEADS, model)
    prompts = eval_prompts(tok, md, 4)
    max_len = max(map(len, prompts)) + 33
    proposer = TreeProposer(heads, [(0,) * d for d in range(1, heads.depth + 1)], lookup=10,
                            adaptive_lookup="agree", first_drafts=True)
    programs, init = [], tree_program.TreeProgram.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        programs.append(self)
    tree_program.TreeProgram.__init__ = record
    llm = LLM(model, max_num_seqs=1, block_size=16, max_model_len=max_len,
              num_blocks=-(-max_len // 16) + private_blocks(proposer), decode_path="static",
              gemv_rows=64, compile=True, launch_behind_prompt=True)
    llm.set_proposer(proposer)
    params = SamplingParams(temperature=0.0, max_tokens=32, exit_policy="fixed")
    for _ in range(2):
        llm.generate(prompts, params)
    program = next(p for p in programs if p._graph is not None and p.follow and p.lookup_rows
                   and not p.first_drafts)
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    limit = torch.full((1,), n, dtype=torch.int64, device="cuda")
    tick = KeptGraph()
    counter.add_(1)
    with torch.cuda.graph(tick):
        counter.add_(1)
    loop = WhileLoop(lib, [program._graph, tick], counter, limit)
    saved = (program.index.clone(), program.tree.cand_in.clone())

    def restore():
        program.index.copy_(saved[0])
        program.tree.cand_in.copy_(saved[1])
        counter.zero_()

    def host_loop():
        for _ in range(n):
            program.launch()
            program.read()

    def device_loop():
        loop.launch()
    restore()
    host_loop()
    torch.cuda.synchronize()
    by_host = (program.out.clone(), program.index[:5].clone())
    restore()
    device_loop()
    torch.cuda.synchronize()
    same = bool(torch.equal(program.out, by_host[0]) and
                torch.equal(program.index[:5], by_host[1]))
    times = {}
    for name, fn in (("host loop (launch + read)", host_loop), ("while loop", device_loop)):
        times[name] = seconds(lambda: (restore(), fn())) / n
    return {"program": {"chain": program.chain, "follow": program.follow, "rows": program.rows},
            "iterations_ran": int(counter.item()), "same_state_as_host_loop": same,
            "us_per_iteration": {k: round(v * 1e6, 2) for k, v in times.items()}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--iterations", type=int, default=64)
    ap.add_argument("--arch", default="sm_90")
    args = ap.parse_args()
    if args.device != "cuda" or not torch.cuda.is_available():
        raise SystemExit("this probe builds and launches CUDA graphs: --device cuda on a GPU")
    if args.iterations < 1:
        ap.error("--iterations must be >= 1")
    torch.cuda.init()
    lib = build_library(args.arch)
    torch.cuda.CUDAGraph = KeptGraph          # the engine's captures keep their graphs
    result = {"torch": torch.__version__, "cuda": torch.version.cuda,
              "iterations": args.iterations}
    for name, part in (("A", part_a), ("B", part_b)):
        try:
            result[name] = part(lib, args.iterations)
        except Exception as exc:   # report each part's failure, keep the other's result
            result[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(name, json.dumps(result[name]), flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
