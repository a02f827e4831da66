"""Issue 17: does the order in which KV blocks are handed out move W7's closed loop?

The block manager's free list is FIFO: a freed block goes to the back, so with a 110 GiB cache
every loop of 256 requests takes blocks further along the pool, and from the second loop on a
mix of fresh and recycled ones. The blocks in use end up spread over each (layer, k/v, plane)
slab of the cache, differently in every loop; a W7 round step reads all four planes at once
(its rows sit at different rounds), a W6 round one. Here the same loops run with the FIFO
list and with a lowest-id-first pool (a heap: the blocks in use stay packed at the slab's
start), W7 `--loops` times and W6 two times each, one engine per (workload, pool) with its own
warm-up. Last line: JSON.

    python docs/experiments/scripts/block_order_probe_h200.py --loops 4
"""
import heapq
import json
import sys
from types import SimpleNamespace

from rltlab.bench import engine_checks
from rltlab.bench.__main__ import build_model, prompts_for
from rltlab.bench.ceilings import ModelCosts
from rltlab.bench.engine import WORKLOADS, make_llm, scaled, warm_up, workload_params


class LowestFirst:
    """The free list's interface (popleft, append, len, iteration) over a min-heap."""

    def __init__(self, blocks):
        self.heap = sorted(blocks)

    def popleft(self) -> int:
        return heapq.heappop(self.heap)

    def append(self, block: int) -> None:
        heapq.heappush(self.heap, block)

    def __len__(self) -> int:
        return len(self.heap)

    def __iter__(self):
        return iter(self.heap)


def loops_of(model, name: str, pool: str, loops: int, kv_gib: float, scale: float) -> dict:
    spec = scaled(WORKLOADS[name], scale)
    prompts = prompts_for(spec["requests"], spec["prompt_len"], model.config.vocab_size, seed=7)
    params = workload_params(spec, model.config.num_rounds, spec["requests"],
                             model.config.vocab_size)
    costs, c = ModelCosts.of(model), spec["concurrency"]
    llm = make_llm(model, spec, "graph", kv_gib)
    blocks = llm.llm_engine.block_manager
    if pool == "lowest":
        blocks.free_blocks = LowestFirst(blocks.free_blocks)
    warm_up(llm, prompts, params, c)
    runs = []
    for i in range(loops):
        loop, _ = engine_checks.closed_loop(llm, prompts, params, c, costs)
        runs.append(loop["tok_s"])
        print(f"{name} {pool} loop {i}: {loop['tok_s']} tok/s ({blocks.num_blocks} blocks)",
              flush=True)
    del llm, blocks
    engine_checks.free_device_memory()
    return {"workload": name, "pool": pool, "tok_s": runs}


def main(loops: int, device: str, preset: str, kv_gib: float, scale: float) -> dict:
    model = build_model(SimpleNamespace(model=None, preset=preset, device=device,
                                        dtype="bfloat16" if device == "cuda" else "float32"))
    runs = [loops_of(model, name, pool, n, kv_gib, scale)
            for name, n in (("W7", loops), ("W6", 2)) for pool in ("fifo", "lowest")]
    return {"runs": runs}


def option(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


if __name__ == "__main__":
    # CPU smoke test: --device cpu --preset tiny --kv-gib 0.5 --loops 1 --scale 0.05
    print(json.dumps(main(int(option("--loops", "4")), option("--device", "cuda"),
                          option("--preset", "ouro-1.4b"), float(option("--kv-gib", "110")),
                          float(option("--scale", "1")))))
