"""Programmatic dependent launch (kernels/pdl.py): where it is available, and that every kernel
that takes pdl=True refuses it, before touching anything, where it is not.

What PDL changes on a GPU (launch order only, so bit-identical results) was checked on a GPU by
a script (in the tree at 093d100): the engine with and without it, fp32, identical tokens and
log-probs; the interpreter cannot run the grid-dependency instructions.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from rltlab import kernels  # noqa: E402
from rltlab.engine import LLM, SamplingParams  # noqa: E402
from rltlab.engine.config import ExecutionConfig  # noqa: E402
from rltlab.kernels.pdl import launch_options  # noqa: E402
from tiny_models import tiny_engine_model  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on CPU")


def test_pdl_is_unavailable_on_cpu_and_under_the_interpreter():
    assert not kernels.pdl_available("cpu")
    assert launch_options(False, "cpu") == {"GDC": False}
    with pytest.raises(ValueError, match="compute capability"):
        launch_options(True, "cpu")


def _rows(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_every_pdl_kernel_refuses_pdl_where_unavailable_and_changes_nothing():
    heads, kv_heads, dim = 4, 2, 8
    cache = _rows(0, 1, 2, 2, 4, 4, kv_heads, dim)   # [layers, k/v, planes, blocks, bs, H, D]
    before = cache.clone()
    qkv = _rows(1, 2, (heads + 2 * kv_heads) * dim)
    cos, sin = _rows(2, 2, dim), _rows(3, 2, dim)
    planes, slots = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3, 5])
    calls = {
        "small_m_linear": lambda: kernels.small_m_linear(_rows(4, 1, 16), _rows(5, 8, 16),
                                                         pdl=True),
        "rope_write_kv": lambda: kernels.rope_write_kv(qkv, cos, sin, cache, 0, planes, slots,
                                                       heads, kv_heads, dim, pdl=True),
        "rope_kv_linear": lambda: kernels.rope_kv_linear(
            _rows(11, 1, 16), _rows(12, (heads + 2 * kv_heads) * dim, 16), cos[:1], sin[:1],
            cache, 0, planes[:1], slots[:1], heads, kv_heads, dim, pdl=True),
        "add_rmsnorm": lambda: kernels.add_rmsnorm(_rows(6, 1, 16), _rows(7, 1, 16),
                                                   _rows(8, 16), _rows(9, 16), 1e-6, pdl=True),
        "paged_decode_attention": lambda: kernels.paged_decode_attention(
            _rows(10, 1, heads, dim), cache[0, 0], cache[0, 1], planes[:1],
            torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32),
            dim ** -0.5, pdl=True),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match="compute capability"):
            call()
    assert torch.equal(cache, before)


def test_engine_option_is_validated_and_ignored_where_unavailable():
    with pytest.raises(ValueError, match="pdl must be a bool"):
        ExecutionConfig(pdl="yes")
    llm = LLM(tiny_engine_model(), device="cpu", dtype=torch.float32, decode_path="static",
              max_num_seqs=2, pdl=True)
    assert llm.llm_engine.runner.static.pdl is False
    out = llm.generate([[0, 3, 4]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
