"""The device loop's own cost a program (rltlab.engine.device_loop: WHILE, IF-ELSE, the
decide kernel and its copies), against a host loop that does nothing but launch and read back,
on stand-in programs whose output row never stops the loop:

- "one kernel": one torch.cuda._sleep kernel of about a tree program's device time;
- "137 kernels": 137 small kernels (a tree program's count).

Host loop: replay the program's graph, copy its row to pinned memory, wait for it, read it (as
TreeProgram.launch / read do; the engine's own turn between programs, 37-64 us on the
twenty-seventh session's timelines, is not in it). Device loop: the first program from the
host, then DeviceLoop.launch for the rest, the host reading each row as it lands. Per program =
wall time of N programs / N; 7 repeats interleaved, median.

    python docs/experiments/scripts/device_loop_overhead.py --device cuda
Last line: JSON.
"""
import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch

from rltlab.engine.device_loop import DeviceLoop

SPAN, PROGRAMS = 13, 64


def stand_in(body, hits: int) -> SimpleNamespace:
    """A program whose row says: nothing accepted, a bonus that is no stop token, finite,
    live, `hits` (the next rows), 5 tokens left."""
    out = torch.tensor([0] + [0] * SPAN + [99, 1, 1, hits], device="cuda")
    index = torch.tensor([0, 0, 5, 0, 0], device="cuda")
    body()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        body()
    return SimpleNamespace(out=out, index=index, width=SPAN + 5, _graph=graph, _program=body,
                           static=SimpleNamespace(cuda_graphs=True))


def host_loop(program, host_row, done) -> float:
    start = time.perf_counter()
    for _ in range(PROGRAMS):
        program._graph.replay()
        host_row.copy_(program.out, non_blocking=True)
        done.record()
        done.synchronize()
        host_row.tolist()
    return (time.perf_counter() - start) / PROGRAMS * 1e6


def device_loop(loop, program) -> float:
    start = time.perf_counter()
    program._graph.replay()
    loop.launch(PROGRAMS, frozenset())
    for i in range(PROGRAMS):
        loop.row(i)
    return (time.perf_counter() - start) / PROGRAMS * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sleep-cycles", type=int, default=900_000,
                        help="the one-kernel body (~0.45 ms at 1.98 GHz)")
    args = parser.parse_args()
    if torch.device(args.device).type != "cuda":
        raise SystemExit("this times CUDA graphs: --device cuda")
    scratch = torch.zeros(64, device="cuda")

    def many():
        for _ in range(137):
            scratch.add_(1)
    bodies = {"one kernel": lambda: torch.cuda._sleep(args.sleep_cycles), "137 kernels": many}
    tree = SimpleNamespace(proposer=SimpleNamespace(span=SPAN, adaptive_lookup="agree"))
    host_row = torch.zeros(SPAN + 5, dtype=torch.long, pin_memory=True)
    done = torch.cuda.Event()
    report = {"gpu": torch.cuda.get_device_name(), "programs": PROGRAMS, "bodies": {}}
    for name, body in bodies.items():
        program = stand_in(body, hits=1)
        loop = DeviceLoop(tree, {True: program, False: stand_in(body, hits=1)}, PROGRAMS)
        host_loop(program, host_row, done), device_loop(loop, program)   # warm-up
        times = {"host loop": [], "device loop": []}
        for _ in range(7):
            times["host loop"].append(host_loop(program, host_row, done))
            times["device loop"].append(device_loop(loop, program))
        assert loop.row(PROGRAMS - 1)[-1] == 1 and int(loop.count) == PROGRAMS
        medians = {k: round(statistics.median(v), 2) for k, v in times.items()}
        report["bodies"][name] = {"per_program_us": medians,
                                  "device_minus_host_us": round(medians["device loop"]
                                                                - medians["host loop"], 2),
                                  "all_us": {k: [round(x, 2) for x in v]
                                             for k, v in times.items()}}
        print(f"{name:>12}: host loop {medians['host loop']:.1f} us a program, device loop "
              f"{medians['device loop']:.1f} us")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
