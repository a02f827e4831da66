"""The loop's two engines share a GPU's memory (rltlab.loop.memory): on an H100 the GSM8K loop's
main engine, left to size its own pool for 4,096-token sequences, took all of it and the gate
check's engine failed with "no GPU memory left for the KV cache" in iteration 0."""
from __future__ import annotations

import pytest

from rltlab.engine.config import ACTIVATION_RESERVE_GIB
from rltlab.loop import memory

GIB = 2 ** 30
# Ouro-1.4B in bf16: 2 x 1,434,652,673 bytes; a 4,096-token sequence's K/V: 4 rounds x 24 layers
# x (K, V) x 16 heads x 128 x 2 bytes per token
MODEL = 2 * 1_434_652_673
SEQUENCE = 4096 * 4 * 24 * 2 * 16 * 128 * 2


def test_the_split_by_hand():
    total, used = 80 * GIB, 3 * GIB
    main, check = memory.split_kv_memory(total - used, total, MODEL, SEQUENCE, 0.9)
    budget = (0.9 * 80 - 3) - 2 * MODEL / GIB - 2 * ACTIVATION_RESERVE_GIB
    assert main == pytest.approx(0.75 * budget) and check == pytest.approx(0.25 * budget)
    # both pools, both engine copies and both reserves fit in what the utilization allows
    assert main + check + 2 * MODEL / GIB + 2 * ACTIVATION_RESERVE_GIB + 3 \
        == pytest.approx(0.9 * 80)
    assert check > SEQUENCE / GIB   # the gate check holds a 4,096-token sequence (3.0 GiB)


def test_a_gpu_too_small_for_both_engines_is_one_error_with_the_figures():
    total = 24 * GIB
    with pytest.raises(ValueError, match=r"do not fit: 3.0 of 24.0 GiB in use.*gate check's "
                                         r"25% share \(2.3 GiB\).*3.00 GiB"):
        memory.split_kv_memory(total - 3 * GIB, total, MODEL, SEQUENCE, 0.9)


def test_off_cuda_or_sized_by_the_caller_nothing_is_split():
    import torch

    model = torch.nn.Linear(2, 2)
    assert memory.engine_memory(model, {"max_model_len": 64}) is None
    # (on CUDA too: the caller's own kv_cache_memory_gib / num_blocks win)


@pytest.mark.slow
def test_setup_gives_each_engine_its_share(tmp_path, monkeypatch):
    """The main engine is built with the main share and the gate check's with the rest."""
    from rltlab.loop import LoopConfig, setup
    from rltlab.model.checkpoint import load_model
    from tiny_models import write_tiny_checkpoint

    monkeypatch.setattr(memory, "engine_memory", lambda model, kwargs: (0.3, 0.1))
    model_dir = write_tiny_checkpoint(tmp_path / "model")
    model, tok, _ = load_model(model_dir, threads=1)
    state = setup(tmp_path / "run", model, tok, LoopConfig(iterations=1, eval_problems=2),
                  model_dir=model_dir)
    assert state.llm.llm_engine.config.kv_cache_memory_gib == 0.3
    assert state.gate_check_llm().llm_engine.config.kv_cache_memory_gib == 0.1
