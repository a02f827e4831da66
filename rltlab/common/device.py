"""Host -> device copies that never wait for the device."""
from __future__ import annotations

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host list -> device tensor without waiting for the device (pinned, async on CUDA)."""
    tensor = torch.tensor(values, dtype=dtype, pin_memory=torch.device(device).type == "cuda")
    return tensor.to(device, non_blocking=True)
