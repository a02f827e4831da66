"""Test-wide setup: Triton kernels run in the interpreter when there is no GPU."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu skip where there is no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    """Under the interpreter, stop before any test with what to install where the installed
    Triton and NumPy cannot run the kernels (kernels/interpreter.py), rather than fail most
    kernel tests with an error from inside the interpreter."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return   # (importing the kernels here would fix triton's mode before a test file sets it)
    from rltlab.kernels import interpreter_problem
    problem = interpreter_problem()
    if problem:
        raise pytest.UsageError(problem)
