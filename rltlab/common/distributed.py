"""Rank / world helpers for data-parallel work over accelerate's PartialState.

One code path: under `accelerate launch --num_processes N` (or torchrun) every rank runs the
same code on its shard; as a plain process the world is one rank and every helper degrades to
the single-process behaviour (no process group, gathers return the local list).

Sharding is by *blocks* ("waves") of consecutive global indices: block b holds indices
[b * block, (b + 1) * block) and belongs to rank b % world. A block is also the unit of engine
work (one `generate` call on an idle engine), so a block's batch composition, and with it every
floating-point result, is the same whatever the world size: N ranks reproduce the tokens of one
process bit for bit, not only "within noise".
"""
from __future__ import annotations

import os
import socket
import sys
from typing import Any, Callable, Sequence

import torch

ACCELERATE_CONFIG_ENV = "RLTLAB_ACCELERATE_CONFIG"
_SEED_MOD = 2 ** 63
_SEED_MIX = 0x9E3779B97F4A7C15   # odd 64-bit constant: distinct prompts -> well spread seeds


def get_state(device: str | None = None):
    """accelerate's PartialState; device "cpu" (or no CUDA) uses gloo, else NCCL, one GPU per
    rank (cuda:LOCAL_RANK). Initializes the process group on first use under a launcher."""
    from accelerate import PartialState

    cpu = device == "cpu" or (device is None and not torch.cuda.is_available())
    if device is not None and device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for but CUDA is not available")
    return PartialState(cpu=cpu)


def shard_blocks(num_items: int, block: int, world: int, rank: int) -> list[range]:
    """The blocks of global indices that `rank` of `world` owns (block b -> rank b % world)."""
    if block < 1:
        raise ValueError(f"block size must be >= 1, got {block}")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    if num_items < 0:
        raise ValueError(f"num_items must be >= 0, got {num_items}")
    starts = range(0, num_items, block)
    return [range(s, min(s + block, num_items)) for b, s in enumerate(starts) if b % world == rank]


def shard_indices(num_items: int, block: int, world: int, rank: int) -> list[int]:
    return [i for blk in shard_blocks(num_items, block, world, rank) for i in blk]


def prompt_seed(base_seed: int, prompt_id: int) -> int:
    """A request's seed from the run's base seed and the GLOBAL prompt id (never the rank), so a
    sampled rollout is the same however the prompts were sharded."""
    return (int(base_seed) + (int(prompt_id) + 1) * _SEED_MIX) % _SEED_MOD


def gather_indexed(state, local: Sequence[tuple[int, Any]], num_items: int) -> list[Any]:
    """(global index, item) pairs of every rank -> the items in global order, on every rank.
    Raises when an index is missing or given twice (a sharding bug would otherwise silently
    drop or duplicate results)."""
    pairs = list(local)
    if state.num_processes > 1:
        from accelerate.utils import gather_object
        pairs = gather_object(pairs)
    out: list[Any] = [None] * num_items
    seen = [False] * num_items
    for index, item in pairs:
        if not 0 <= index < num_items or seen[index]:
            raise RuntimeError(f"gathered result index {index} is out of range or duplicated")
        out[index], seen[index] = item, True
    if not all(seen):
        raise RuntimeError(f"gathered {sum(seen)} of {num_items} results")
    return out


def sharded_generate_fn(generate_fn: Callable, state, block: int,
                        light: Callable = lambda out: out) -> Callable:
    """A generate_fn (rltlab.eval.tasks: prompts -> outputs) whose calls are split across ranks
    in blocks and gathered back in order, so evaluation code runs unchanged on every rank and
    every rank computes the same metrics. Every rank must make the same calls (collective).
    light(output): the picklable part of an output that the metrics read, sent between ranks
    (rltlab.eval.tasks.as_gen_output)."""
    def generate(prompts):
        pairs = []
        for blk in shard_blocks(len(prompts), block, state.num_processes, state.process_index):
            outs = generate_fn([prompts[i] for i in blk])
            pairs += [(i, light(o)) for i, o in zip(blk, outs)]
        return gather_indexed(state, pairs, len(prompts))
    return generate


def sum_gradients(params: Sequence[torch.Tensor], state) -> None:
    """Sum the gradients of `params` over the ranks, in place (one all-reduce of a flat buffer
    through accelerate.utils.reduce; a rank without a gradient for a parameter adds zeros).
    Collective: every rank calls it with the same parameters. No-op for one process (state None
    or a world of one), so the single-process numbers are untouched."""
    if state is None or state.num_processes == 1:
        return
    from accelerate.utils import reduce

    params = list(params)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = reduce(torch.cat([g.reshape(-1) for g in grads]), "sum")
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset: offset + g.numel()].view_as(p).to(p.dtype).clone()
        offset += g.numel()


def broadcast_parameters(params: Sequence[torch.Tensor], state, src: int = 0) -> None:
    """Overwrite `params` with rank `src`'s values on every rank (accelerate.utils.broadcast of
    a flat buffer), so data-parallel replicas start identical whatever each rank initialized.
    Collective; no-op for one process."""
    if state is None or state.num_processes == 1:
        return
    from accelerate.utils import broadcast

    params = list(params)
    with torch.no_grad():
        flat = broadcast(torch.cat([p.detach().reshape(-1) for p in params]).contiguous(),
                         from_process=src)
        offset = 0
        for p in params:
            p.copy_(flat[offset: offset + p.numel()].view_as(p))
            offset += p.numel()


def reduce_weighted(values: dict[str, float], weight: float, state) -> dict[str, float]:
    """sum over the ranks of weight * value, per key (weights = each rank's share of a global
    batch: the global batch's mean of per-rank means). Collective; every rank passes the same
    keys. One process: `values` unchanged (weight 1)."""
    if state is None or state.num_processes == 1:
        return dict(values)
    from accelerate.utils import reduce

    keys = sorted(values)
    local = torch.tensor([float(values[k]) * weight for k in keys], dtype=torch.float64,
                         device=state.device)
    summed = dict(zip(keys, reduce(local, "sum").cpu().tolist()))
    return {k: summed[k] for k in values}


def configure_threads(threads: int | None, device: str) -> int:
    """torch CPU threads of this rank: `threads`, or on the CPU the cores divided between the
    ranks on this host (ranks that oversubscribe cores measure contention, not scaling)."""
    if threads is None:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        threads = max(1, (os.cpu_count() or 1) // local_world) if device == "cpu" else None
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def shutdown() -> None:
    """End this rank's process group: a last barrier, then destroy it. A rank that leaves the
    interpreter with its gloo group alive can abort in the C++ teardown after its work is done
    ("terminate called without an active exception", exit -6: seen once in CI on a collect
    whose result was already written). No group (one process): nothing to do."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_argv(module: str, args: Sequence[str], num_processes: int) -> list[str]:
    """argv that runs `python -m module args` as `num_processes` ranks. One process: a plain
    interpreter (no launcher). Several: `accelerate launch --multi_gpu` (its torchrun path; the
    worker's PartialState(cpu=True) makes it a gloo CPU group when the device is the CPU), or
    with $RLTLAB_ACCELERATE_CONFIG set, `accelerate launch --config_file` that file (e.g. an
    FSDP config; see docs/scale_out.md)."""
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    if num_processes == 1:
        return [sys.executable, "-m", module, *args]
    config = os.environ.get(ACCELERATE_CONFIG_ENV)
    mode = ["--config_file", config] if config else [
        "--multi_gpu", "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no"]
    return [sys.executable, "-m", "accelerate.commands.launch", *mode, "--num_processes",
            str(num_processes), "--main_process_port", str(free_port()), "-m", module, *args]
