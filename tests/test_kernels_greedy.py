"""kernels.greedy_tokens under TRITON_INTERPRET=1 against torch.argmax / isfinite: exact (the
tokens are indices; ties must resolve to the first maximum as torch.argmax does)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from rltlab.kernels import greedy_tokens, greedy_tokens_ref, triton_available  # noqa: E402
from rltlab.kernels import greedy  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not triton_available(DEVICE),
                                reason="needs a GPU or TRITON_INTERPRET=1 before import")


def _logits(rows, vocab, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(rows, vocab, generator=g)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 61), (5, 300), (3, 20000)])
def test_greedy_tokens_match_argmax(dtype, rows, vocab, monkeypatch):
    monkeypatch.setattr(greedy, "BLOCK", 128)   # several blocks per row, a ragged last one
    logits = _logits(rows, vocab, dtype, seed=rows + vocab)
    tokens, finite = greedy_tokens(logits)
    ref_tokens, ref_finite = greedy_tokens_ref(logits)
    assert tokens.dtype == torch.int64 and finite.dtype == torch.bool
    assert torch.equal(tokens, ref_tokens) and torch.equal(finite, ref_finite)
    assert finite.all()


def test_ties_resolve_to_the_first_maximum_across_lanes_and_blocks(monkeypatch):
    monkeypatch.setattr(greedy, "BLOCK", 64)
    logits = _logits(4, 500, torch.bfloat16, seed=1)
    for row, where in enumerate([(7, 300), (70, 71), (499, 130), (3, 67, 131)]):
        logits[row, list(where)] = 50.0   # equal maxima: in one lane, neighbours, ...
    tokens, _ = greedy_tokens(logits)
    assert tokens.tolist() == [7, 70, 130, 3] == greedy_tokens_ref(logits)[0].tolist()


def test_rows_with_nan_or_inf_are_not_finite(monkeypatch):
    monkeypatch.setattr(greedy, "BLOCK", 64)
    logits = _logits(5, 200, torch.float32, seed=2)
    logits[1, 150] = float("nan")
    logits[2, 3] = float("inf")
    logits[3, 199] = float("-inf")
    tokens, finite = greedy_tokens(logits)
    assert finite.tolist() == [True, False, False, False, True]
    ref_tokens, _ = greedy_tokens_ref(logits)
    assert tokens[[0, 3, 4]].tolist() == ref_tokens[[0, 3, 4]].tolist()   # -inf loses anyway


def test_greedy_tokens_rejects_bad_input():
    with pytest.raises(ValueError, match="float logits"):
        greedy_tokens(torch.zeros(2, 5, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="float logits"):
        greedy_tokens(_logits(4, 6, torch.float32, seed=0).T)
    empty = greedy_tokens(_logits(0, 6, torch.float32, seed=0))
    assert empty[0].shape == (0,) and empty[1].shape == (0,)
