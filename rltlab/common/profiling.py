"""Where a call's time goes: its device time (torch.profiler's kernels summed by class, beside
the call's wall time) and its host time (cProfile's heaviest functions), for the benches'
--profile options and rltlab.traces.collection_overhead."""
from __future__ import annotations

import contextlib
import gc
import re
import time

import torch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# Kernel classes of phase_profile, first match wins (kernel names of cuBLAS / CUTLASS, the
# project's Triton kernels and PyTorch's own).
KERNEL_CLASSES = (
    ("attention", re.compile(r"attn|attention|flash|fmha|paged|shared_prefix|_decode_kernel"
                             r"|merge_splits|_prefill_kernel", re.I)),
    ("matmul", re.compile(r"gemm|gemv|cutlass|nvjet|sm90_|small_m|matmul|linear|::(add)?mm\b"
                          r"|bmm", re.I)),
    ("norm_rope_act", re.compile(r"norm|rope|rotary|silu|gelu|act_mul", re.I)),
    ("sampling", re.compile(r"argmax|softmax|sort|cumsum|scan|searchsorted|topk|greedy", re.I)),
    ("copy_index", re.compile(r"copy|memcpy|memset|index|scatter|gather|cat|fill", re.I)),
)


def phase_profile(fn, top: int = 10) -> dict:
    """Where the device time of one fn() call goes (torch.profiler): its wall time, the summed
    kernel time by KERNEL_CLASSES, and the device's idle share (1 - kernel time / wall: launch
    gaps, host work the device waits for). The profiler adds a little to the wall time, so the
    idle share is an upper bound. On CUDA the kernels are the GPU's; elsewhere the CPU's
    operators stand in for them (a smoke check: they nest, so their sum is not the busy time)."""
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available()
    activity, kind = (ProfilerActivity.CUDA, "CUDA") if cuda else (ProfilerActivity.CPU, "CPU")
    _sync()
    with profile(activities=[activity]) as prof:
        start = time.perf_counter()
        fn()
        _sync()
        wall_us = 1e6 * (time.perf_counter() - start)
    own = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    events = sorted((e for e in prof.key_averages() if e.device_type.name == kind),
                    key=lambda e: -own(e))
    classes: dict[str, float] = {}
    for event in events:
        name = next((label for label, pattern in KERNEL_CLASSES if pattern.search(event.key)),
                    "other")
        classes[name] = classes.get(name, 0.0) + own(event)
    kernel_us = sum(classes.values())
    return {"wall_ms": round(wall_us / 1e3, 2), "kernel_ms": round(kernel_us / 1e3, 2),
            "idle_pct": round(100 * max(0.0, 1 - kernel_us / wall_us), 1),
            "kernel_ms_by_class": {k: round(v / 1e3, 2) for k, v in
                                   sorted(classes.items(), key=lambda kv: -kv[1])},
            "launches": sum(e.count for e in events),
            "top_kernels": [[e.key[:70], round(own(e) / 1e3, 2), e.count] for e in events[:top]]}


@contextlib.contextmanager
def host_pauses():
    """Count what stalls a host thread without showing in its own functions, over the block:
    Python's garbage collector (collections and their seconds, through gc.callbacks) and, on
    CUDA, the caching allocator's calls to cudaMalloc (device_allocs) and its retries
    (alloc_retries: a failed cudaMalloc frees the whole cache and synchronizes). Yields a
    dict that holds the counts once the block has ended."""
    counts = {"gc_collections": 0, "gc_s": 0.0}
    started = []

    def on_gc(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            counts["gc_collections"] += 1
            counts["gc_s"] += time.perf_counter() - started.pop()

    def allocator():
        if not torch.cuda.is_available():
            return {}
        stats = torch.cuda.memory_stats()
        return {"device_allocs": stats.get("num_device_alloc", 0),
                "alloc_retries": stats.get("num_alloc_retries", 0)}

    before = allocator()
    gc.callbacks.append(on_gc)
    try:
        yield counts
    finally:
        gc.callbacks.remove(on_gc)
        counts["gc_s"] = round(counts["gc_s"], 4)
        counts.update({k: v - before[k] for k, v in allocator().items()})


def host_profile(fn, top: int = 12) -> dict:
    """Where the host time of one fn() call goes (cProfile): its wall time and the `top`
    functions by their own time, each [where, calls, own ms, cumulative ms]. A device-bound
    call shows its waits (synchronize, item, tolist) here; a host-bound one, its Python."""
    import cProfile
    import pstats

    _sync()
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    fn()
    _sync()
    profiler.disable()
    wall_ms = 1e3 * (time.perf_counter() - start)
    stats = pstats.Stats(profiler).stats   # (file, line, name) -> (prim calls, calls, tt, ct, _)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return {"wall_ms": round(wall_ms, 2),
            "functions": [[f"{name} ({file.rsplit('/', 1)[-1]}:{line})", calls,
                           round(1e3 * own, 2), round(1e3 * cumulative, 2)]
                          for (file, line, name), (_, calls, own, cumulative, _) in rows]}
