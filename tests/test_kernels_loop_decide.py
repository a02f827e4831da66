"""kernels.loop_decide (the device loop's decision after each tree program) under
TRITON_INTERPRET=1 against loop_decide_ref, the torch rules: exact (integers), on random rows
whose tokens often are stop tokens, before and past n, with live / finite / hits / tokens left
drawn at random and runs of decisions that fill the ring up to its limit."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from rltlab.kernels import loop_decide, loop_decide_ref, triton_available  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not triton_available(DEVICE),
                                reason="needs a GPU or TRITON_INTERPRET=1 before import")
STOPS = 8


def _state(span: int, capacity: int, limit: int, stops: list[int]) -> dict:
    width = span + 5
    return {"count": torch.zeros(1, dtype=torch.long, device=DEVICE),
            "ring": torch.full((capacity, width), -7, dtype=torch.long, device=DEVICE),
            "limit": torch.tensor([limit], device=DEVICE),
            "stops": torch.tensor(stops + [-1] * (STOPS - len(stops)), device=DEVICE),
            "flags": torch.full((2,), 5, dtype=torch.int32, device=DEVICE)}


def _random_row(span: int, gen: torch.Generator) -> torch.Tensor:
    def draw(high, size=1):
        return torch.randint(0, high, (size,), generator=gen)
    # tokens from a small vocabulary, so stop tokens turn up before and past n; finite and
    # live mostly 1, so that the stop tokens decide
    finite, live = (draw(8) > 0).long(), (draw(8) > 0).long()
    return torch.cat([draw(span + 1), draw(6, span), draw(6), finite, live, draw(3)])


@pytest.mark.parametrize("span", [3, 13])
@pytest.mark.parametrize("adaptive", [True, False])
def test_loop_decide_matches_the_torch_rules(span, adaptive):
    gen = torch.Generator().manual_seed(span + 100 * adaptive)
    for trial in range(24):
        capacity = 1 + trial % 5
        limit = int(torch.randint(1, capacity + 2, (1,), generator=gen))
        stops = torch.randint(0, 6, (trial % 4,), generator=gen).tolist()
        ours, ref = _state(span, capacity, limit, stops), _state(span, capacity, limit, stops)
        for step in range(capacity):
            row = _random_row(span, gen).to(DEVICE)
            left = torch.randint(0, 5, (1,), generator=gen).clamp(max=2).to(DEVICE)
            loop_decide(row, left, **ours, span=span, adaptive=adaptive)
            loop_decide_ref(row, left, **ref, span=span, adaptive=adaptive)
            for name in ref:
                assert torch.equal(ours[name], ref[name]), (trial, step, name, row.tolist())
        assert int(ours["count"]) == capacity


def test_a_count_past_the_capacity_writes_no_row():
    state = _state(span=3, capacity=2, limit=5, stops=[])
    state["count"].fill_(2)
    row = torch.arange(1, 9, device=DEVICE)
    loop_decide(row, torch.ones(1, dtype=torch.long, device=DEVICE), **state, span=3,
                adaptive=False)
    assert (state["ring"] == -7).all() and int(state["count"]) == 3
    assert state["flags"].tolist() == [1, 1]   # 3 < 5, live, finite, left; no stop tokens


def test_bad_shapes_and_dtypes_are_refused():
    state = _state(span=3, capacity=2, limit=2, stops=[4])
    left = torch.ones(1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="span \\+ 5 = 8"):
        loop_decide(torch.zeros(9, dtype=torch.long, device=DEVICE), left, **state, span=3,
                    adaptive=True)
    with pytest.raises(ValueError, match="int32 flags"):
        loop_decide(torch.zeros(8, dtype=torch.int32, device=DEVICE), left, **state, span=3,
                    adaptive=True)
    with pytest.raises(ValueError, match="contiguous"):
        loop_decide(torch.zeros(16, dtype=torch.long, device=DEVICE)[::2], left, **state,
                    span=3, adaptive=True)
    assert int(state["count"]) == 0 and (state["ring"] == -7).all()
