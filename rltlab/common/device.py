"""Host -> device copies that never wait for the device."""
from __future__ import annotations

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host list -> device tensor without waiting for the device (pinned, async on CUDA)."""
    tensor = torch.tensor(values, dtype=dtype, pin_memory=torch.device(device).type == "cuda")
    return tensor.to(device, non_blocking=True)


def tensor_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor -> device without waiting for the device: a plain .to(cuda) of pageable
    memory blocks the host until the copy, and so everything queued before it, is done, and
    the host then prepares the next step while the device idles. Pinned and async on CUDA
    (torch's pinned allocator keeps the buffer until the copy has run)."""
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
