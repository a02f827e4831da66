"""GPU memory of the loop's two engines: the main one (rollouts, evaluation, deployed rows) and
the gate check's private one (made in iteration 0, next to the first).

An engine left to size its own KV pool takes most of the free memory when its sequences may be
long (EngineConfig.resolve_num_blocks): at the Ouro-1.4B shape a 4,096-token sequence holds
3.2 GB of K/V (4 rounds x 24 layers), so the main engine of a GSM8K loop took all of an 80 GB
GPU and the gate check's engine then found none. On CUDA the loop splits the memory up front
instead: after the model and each engine's copy of it, and ACTIVATION_RESERVE_GIB per engine for
activations and the training steps, MAIN_SHARE of the rest goes to the main engine's pool and the
remainder to the gate check's.
"""
from __future__ import annotations

from rltlab.engine.config import ACTIVATION_RESERVE_GIB, EngineConfig

MAIN_SHARE = 0.75   # the main engine runs every rollout and evaluation; the check, a subset
GIB = 2 ** 30


def split_kv_memory(free_bytes: int, total_bytes: int, model_bytes: int,
                    sequence_bytes: int, utilization: float) -> tuple[float, float]:
    """(main, gate check) KV pool GiB from the device's free / total memory now, the model's
    bytes (each engine works on its own copy, not made yet) and one longest sequence's K/V
    bytes (each pool must hold one); ValueError with the figures where they do not fit."""
    used = total_bytes - free_bytes
    budget = (total_bytes * utilization - used - 2 * model_bytes) / GIB \
        - 2 * ACTIVATION_RESERVE_GIB
    main, check = MAIN_SHARE * budget, (1 - MAIN_SHARE) * budget
    if check < sequence_bytes / GIB:
        raise ValueError(
            f"the loop's two engines do not fit: {used / GIB:.1f} of {total_bytes / GIB:.1f} "
            f"GiB in use, two engine copies of the model ({2 * model_bytes / GIB:.1f} GiB) and "
            f"{2 * ACTIVATION_RESERVE_GIB:g} GiB kept for activations leave {budget:.1f} GiB of "
            f"K/V at gpu_memory_utilization={utilization}; the gate check's "
            f"{1 - MAIN_SHARE:.0%} share ({check:.1f} GiB) must hold one sequence of "
            f"max_model_len tokens ({sequence_bytes / GIB:.2f} GiB): lower MAX_TOKENS (GSM8K: "
            "GSM8K_FEWSHOT too) or use a GPU with more memory")
    return main, check


def engine_memory(model, engine_kwargs: dict) -> tuple[float, float] | None:
    """split_kv_memory for `model` where it is and the engines' LLM(...) arguments: None off
    CUDA, or where the caller sized the pools itself (kv_cache_memory_gib / num_blocks)."""
    import torch

    device = next(model.parameters()).device
    if device.type != "cuda" or {"kv_cache_memory_gib", "num_blocks"} & set(engine_kwargs):
        return None
    from rltlab.eval.engines import kv_block_bytes

    element = next(model.parameters()).element_size()
    sequence = engine_kwargs["max_model_len"] * kv_block_bytes(model.config, 1, element)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    free, total = torch.cuda.mem_get_info(device)
    utilization = engine_kwargs.get("gpu_memory_utilization",
                                    EngineConfig.gpu_memory_utilization)
    return split_kv_memory(free, total, model_bytes, sequence, utilization)
