"""Device time of the device loop's decide step, as the loop runs it: the torch rules
(kernels.loop_decide_ref, ~25 small ops) against the one Triton kernel (kernels.loop_decide),
each followed by the ring's and the count's copies to pinned host memory, as DeviceLoop._decide
does. Each is captured 50 times over into one CUDA graph (with the count reset before each, so
the ring never fills) and the graph replayed; per decide = the replays' time / 50 / replays,
interleaved over 7 repeats (median). The claim's width: span 13 (chain 4 + lookup 10, first
drafts), capacity 16, 8 stop slots.

    python docs/experiments/scripts/loop_decide_timing.py --device cuda
Last line: JSON.
"""
import argparse
import json
import statistics

import torch

from rltlab.kernels import loop_decide, loop_decide_ref

SPAN, CAPACITY, STOPS, PER_GRAPH = 13, 16, 8, 50


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--replays", type=int, default=40)
    args = parser.parse_args()
    dev = torch.device(args.device)
    if dev.type != "cuda":
        raise SystemExit("this times CUDA graphs: --device cuda")
    out = torch.tensor([2, *range(100, 100 + SPAN), 7, 1, 1, 1], device=dev)
    left = torch.tensor([5], device=dev)
    count, limit = torch.zeros(1, dtype=torch.long, device=dev), torch.tensor([CAPACITY],
                                                                             device=dev)
    ring = torch.zeros(CAPACITY, SPAN + 5, dtype=torch.long, device=dev)
    stops = torch.tensor([0, 3] + [-1] * (STOPS - 2), device=dev)
    flags = torch.zeros(2, dtype=torch.int32, device=dev)
    host_ring = torch.zeros(ring.shape, dtype=torch.long, pin_memory=True)
    host_count = torch.zeros(1, dtype=torch.long, pin_memory=True)

    def step(decide):
        count.zero_()
        decide(out, left, count, ring, limit, stops, flags, SPAN, True)
        host_ring.copy_(ring, non_blocking=True)
        host_count.copy_(count, non_blocking=True)

    graphs, flags_seen = {}, {}
    for name, decide in (("torch ops", loop_decide_ref), ("triton kernel", loop_decide)):
        step(decide)                                   # warm-up: compile, allocate
        torch.cuda.synchronize()
        flags_seen[name] = flags.tolist() + ring[0].tolist()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(PER_GRAPH):
                step(decide)
        graphs[name] = graph
    assert flags_seen["torch ops"] == flags_seen["triton kernel"], flags_seen
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(7):
        for name, graph in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
            start.record()
            for _ in range(args.replays):
                graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / args.replays / PER_GRAPH)
    report = {"gpu": torch.cuda.get_device_name(), "span": SPAN, "capacity": CAPACITY,
              "per_decide_us": {n: round(statistics.median(t), 2) for n, t in times.items()},
              "all_us": {n: [round(x, 2) for x in t] for n, t in times.items()}}
    for name, us in report["per_decide_us"].items():
        print(f"{name:>14}: {us:.2f} us a decide (with the two copies and a count reset)")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
