"""The host's speed, probed the same way at the start and the end of a paired bench.

At c = 1 both target-only decoding and the tree path spend part of their wall time on the host
(Python, op dispatch, read-backs), and target only's tok/s moved by up to 1.7x between machine
starts at the same code, which moved its paired ratios with it. These probes put a number on
the host each run saw:

  python_us:     a fixed pure-Python loop (list appends and dict lookups), whole loop;
  dispatch_us:   one in-place add on a one-element tensor of the device, per op (launches are
                 asynchronous on a GPU, so this is the host's cost of an op);
  read_back_us:  one tiny op followed by .item(), per round trip (a launch, the device's turn
                 and a copy back: what each engine step's read-back waits on at least).

Each is the median of `repeats` timings.
"""
from __future__ import annotations

import statistics
import time

import torch


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _python_loop() -> None:
    table, out = {i: i * 3 for i in range(64)}, []
    for i in range(20_000):
        out.append(table[i % 64] + i)


def host_speed(device, repeats: int = 5, ops: int = 500) -> dict:
    """{python_us, dispatch_us, read_back_us} on this host and device (module docstring)."""
    if repeats < 1 or ops < 1:
        raise ValueError(f"repeats and ops must be >= 1, got {repeats} and {ops}")
    device = torch.device(device)
    x = torch.ones(1, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def dispatch():
        for _ in range(ops):
            x.add_(1.0)
        sync()

    def read_back():
        for _ in range(ops // 10 or 1):
            x.add_(1.0).item()
    dispatch()   # first calls: allocator, kernel loading
    read_back()
    return {"python_us": _median_time(_python_loop, repeats) * 1e6,
            "dispatch_us": _median_time(dispatch, repeats) * 1e6 / ops,
            "read_back_us": _median_time(read_back, repeats) * 1e6 / (ops // 10 or 1)}
