"""EngineConfig / ExecutionConfig: bad values are one ValueError naming the field, LLM's flat
keyword arguments reach the right one, and the "auto" device and dtype resolve as documented."""
from __future__ import annotations

import pytest
import torch

from rltlab.common.device import default_dtype, resolve_device
from rltlab.engine import LLM, EngineConfig, ExecutionConfig
from rltlab.engine.config import CPU_KV_CACHE_GIB
from rltlab.model.checkpoint import check_fits
from tiny_models import tiny_engine_model


@pytest.mark.parametrize("kwargs, field", [
    (dict(dtype=torch.int8), "EngineConfig.dtype"),
    (dict(dtype="int4"), "EngineConfig.dtype"),
    (dict(kv_cache_memory_gib=float("inf")), "EngineConfig.kv_cache_memory_gib"),
    (dict(kv_cache_memory_gib="2"), "EngineConfig.kv_cache_memory_gib"),
    (dict(kv_cache_memory_gib=float("nan")), "EngineConfig.kv_cache_memory_gib"),
    (dict(gpu_memory_utilization=1.5), "EngineConfig.gpu_memory_utilization"),
    (dict(device="tpu"), "EngineConfig.device"),
    (dict(max_num_seqs=True), "EngineConfig.max_num_seqs"),
    (dict(execution="fast"), "EngineConfig.execution"),
])
def test_bad_engine_values_are_one_line_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")) as err:
        EngineConfig(**kwargs)
    assert "\n" not in str(err.value)


def test_spec_pipeline_must_be_a_positive_int():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"ExecutionConfig\.spec_pipeline"):
            EngineConfig.from_kwargs(spec_pipeline=bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_without_cuda_is_one_line():
    with pytest.raises(ValueError, match="EngineConfig.device 'cuda': CUDA is not available"):
        EngineConfig(device="cuda")
    with pytest.raises(ValueError, match="CUDA is not available"):
        LLM(tiny_engine_model(1), device="cuda")


def test_flat_arguments_reach_their_config_and_unknown_ones_are_named():
    config = EngineConfig.from_kwargs(max_num_seqs=3, cuda_graphs=False, token_window=2)
    assert config.max_num_seqs == 3
    assert config.execution == ExecutionConfig(cuda_graphs=False, token_window=2)
    with pytest.raises(ValueError, match=r"unknown engine arguments \['graphs'\]"):
        EngineConfig.from_kwargs(graphs=False)
    with pytest.raises(ValueError, match="ExecutionConfig.token_window"):
        EngineConfig.from_kwargs(token_window=-1)
    with pytest.raises(ValueError, match="either flat or as execution="):
        EngineConfig.from_kwargs(execution=ExecutionConfig(), pdl=False)


def test_auto_device_and_dtype():
    here = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("auto") == resolve_device(None) == here
    assert default_dtype(torch.device("cpu")) == torch.float32
    assert default_dtype(torch.device("cuda")) == torch.bfloat16
    assert EngineConfig(dtype="auto").dtype is None and EngineConfig(device="auto").device is None
    assert EngineConfig().resolve_dtype(torch.device("cpu")) == torch.float32
    assert EngineConfig().resolve_kv_cache_gib(torch.device("cpu")) == CPU_KV_CACHE_GIB


def test_a_checkpoint_path_loads_on_the_auto_device_in_the_auto_dtype():
    from rltlab.common.paths import embedded_model_dir
    llm = LLM(str(embedded_model_dir()))
    param = next(llm.llm_engine.model.parameters())
    here = resolve_device("auto")
    assert param.device.type == here.type and param.dtype == default_dtype(here)


def test_weights_that_do_not_fit_the_gpu_are_refused_with_the_figures():
    with pytest.raises(ValueError, match=r"need 3\.00 GiB on cuda, which has 1\.00 GiB free"):
        check_fits(3 * 2 ** 30, torch.device("cuda"), "ckpt", free_bytes=2 ** 30)
    check_fits(2 ** 30, torch.device("cuda"), "ckpt", free_bytes=2 ** 31)
    check_fits(2 ** 40, torch.device("cpu"), "ckpt")   # the CPU: not checked
