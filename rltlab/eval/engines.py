"""Engines sized for a workload, so that several can share one GPU, and freeing what one held.

An rltlab.engine.LLM built with no KV size takes, on CUDA, `gpu_memory_utilization` of the
GPU's memory less what is in use (vLLM's rule). One engine per process is what that rule is
for; a notebook builds several (a traced rollout, an evaluation engine, per-concurrency
throughput engines, a private engine for a check), and the second one then finds no memory
left. `sized_llm` gives an engine the KV blocks its workload can use (max_num_seqs sequences of
max_len tokens each: prompt + output) and no more, capped at what the device has free, so
engines coexist; on the CPU it saves host memory the same way. `release_memory` returns the
memory of engines that are gone (garbage collection, then the CUDA caching allocator's cache).
"""
from __future__ import annotations

import gc
import math

import torch

# kept free beside a sized pool on a GPU: activations, CUDA graphs, the allocator's slack,
# teacher-forced forwards of the notebook itself
HEADROOM_GIB = 4.0


def kv_block_bytes(config, block_size: int, elem_size: int) -> int:
    """Bytes of one KV block of the engine's pool (K and V of every layer and round plane:
    rltlab.engine.model_runner's layout, EngineConfig.resolve_num_blocks' formula)."""
    return (config.num_hidden_layers * 2 * config.num_rounds * block_size
            * config.num_key_value_heads * config.head_dim * elem_size)


def kv_blocks(config, *, elem_size: int, max_num_seqs: int, max_len: int,
              block_size: int = 16, free_bytes: int | None = None,
              where: str = "the GPU") -> int:
    """KV blocks for max_num_seqs sequences of max_len tokens (+ one spare block each); with
    free_bytes (a GPU's free memory) capped at what that holds after HEADROOM_GIB, and at
    least one sequence's worth, else a ValueError with the figures."""
    per_block = kv_block_bytes(config, block_size, elem_size)
    per_seq = math.ceil(max_len / block_size) + 1
    blocks = max(1, max_num_seqs) * per_seq
    if free_bytes is not None:
        fits = int(free_bytes - HEADROOM_GIB * 2 ** 30) // per_block
        if fits < per_seq:
            raise ValueError(
                f"no room for an engine's KV cache on {where}: one sequence of {max_len} "
                f"tokens needs {per_seq * per_block / 2 ** 30:.2f} GiB, "
                f"{free_bytes / 2 ** 30:.2f} GiB are free and {HEADROOM_GIB} GiB are kept for "
                "activations; free memory (release_memory), shorten the work or use another GPU")
        blocks = min(blocks, fits)
    return blocks


def sized_num_blocks(model, *, max_num_seqs: int, max_len: int, block_size: int = 16) -> int:
    """kv_blocks for `model`'s shape and dtype; on CUDA capped at the device's free memory."""
    param = next(model.parameters())
    free = torch.cuda.mem_get_info(param.device)[0] if param.device.type == "cuda" else None
    return kv_blocks(model.config, elem_size=param.element_size(), max_num_seqs=max_num_seqs,
                     max_len=max_len, block_size=block_size, free_bytes=free,
                     where=str(param.device))


def sized_llm(model, tokenizer=None, *, max_num_seqs: int, max_len: int, **kwargs):
    """An rltlab.engine.LLM over `model` (where the model is, in its dtype) whose KV pool holds
    max_num_seqs sequences of max_len tokens (sized_num_blocks); kwargs are further EngineConfig
    / ExecutionConfig fields (num_blocks or kv_cache_memory_gib given: used as they are)."""
    from rltlab.engine import LLM

    if "num_blocks" not in kwargs and "kv_cache_memory_gib" not in kwargs:
        kwargs["num_blocks"] = sized_num_blocks(
            model, max_num_seqs=max_num_seqs, max_len=max_len,
            block_size=kwargs.get("block_size", 16))
    return LLM(model, tokenizer, max_num_seqs=max_num_seqs, **kwargs)


def release_memory() -> None:
    """Free what dropped engines and tensors held: a garbage collection (engines hold reference
    cycles) and, on CUDA, the caching allocator's unused blocks (free memory as the next
    engine's sizing reads it)."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def peak_memory_bytes(device) -> int | None:
    """torch.cuda.max_memory_allocated of a CUDA device since its last reset, else None."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))
