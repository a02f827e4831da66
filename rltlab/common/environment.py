"""The hardware and software facts stamped into metrics and benchmark JSON."""
from __future__ import annotations

import platform
from typing import Any

import torch


def environment() -> dict[str, Any]:
    """Hardware/dtype facts to stamp into metrics.json."""
    return {"torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "cuda": torch.cuda.is_available(),
            "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "threads": torch.get_num_threads()}
