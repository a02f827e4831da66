"""rltlab.bench.host: the host probes bench.tree_spec takes at the start and end of a run."""
import time as time_module

import pytest
import torch

from rltlab.bench import host


def test_host_probes_time_what_they_name(monkeypatch):
    """rltlab.bench.host: positive figures; a host made slower (every op and the Python loop
    delayed) reads slower in the probe that times it; bad sizes are refused."""
    fast = host.host_speed("cpu", repeats=3, ops=50)
    assert all(v > 0 for v in fast.values()) and set(fast) == {
        "python_us", "dispatch_us", "read_back_us"}
    loop = host._python_loop
    monkeypatch.setattr(host, "_python_loop", lambda: (time_module.sleep(0.01), loop()))
    assert host.host_speed("cpu", repeats=3, ops=50)["python_us"] > fast["python_us"] + 5000
    add = torch.Tensor.add_
    monkeypatch.setattr(torch.Tensor, "add_", lambda t, v: (time_module.sleep(0.001),
                                                            add(t, v))[1])
    slow = host.host_speed("cpu", repeats=3, ops=50)
    assert slow["dispatch_us"] > fast["dispatch_us"] + 500
    assert slow["read_back_us"] > fast["read_back_us"] + 500
    for bad in ({"repeats": 0}, {"ops": 0}):
        with pytest.raises(ValueError):
            host.host_speed("cpu", **bad)
