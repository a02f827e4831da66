"""Host -> device copies that never wait for the device, and the commands' device check."""
from __future__ import annotations

import argparse

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


def device_problem(name: str) -> str | None:
    """Why `name` cannot be a device this machine runs on (not a torch device string, or CUDA
    where there is none), or None: the commands' check before they write anything."""
    try:
        kind = torch.device(name).type
    except RuntimeError as err:
        return f"{name!r} is not a torch device: {err}"
    if kind == "cuda" and not torch.cuda.is_available():
        return f"{name!r}: CUDA is not available on this machine"
    return None


def device_argument(name: str) -> str:
    """argparse type for a command's --device: a device this machine cannot run on is a usage
    error (exit 2, one "error: argument --device: ..." line) before anything is loaded."""
    problem = device_problem(name)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return name


def default_device() -> str:
    """The commands' default device: cuda where this machine has it, else cpu."""
    return "cuda" if torch.cuda.is_available() else "cpu"


AUTO = "auto"


def resolve_device(name: str | torch.device | None) -> torch.device:
    """A device setting -> the torch.device it names: None or "auto" is default_device(); a
    device this machine cannot run on is a ValueError in one line (device_problem)."""
    if name is None or name == AUTO:
        return torch.device(default_device())
    if isinstance(name, torch.device):
        name = str(name)
    if not isinstance(name, str):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {name!r}")
    problem = device_problem(name)
    if problem is not None:
        raise ValueError(f"device {problem}")
    return torch.device(name)


def default_dtype(device: torch.device) -> torch.dtype:
    """The "auto" dtype: bfloat16 on a GPU (Ouro's own), float32 on the CPU (bf16 matmuls
    there are slow and round every step)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def add_device_argument(parser: argparse.ArgumentParser, default: str | None = None, **kwargs):
    """A command's --device option: checked by device_argument; default (None) default_device();
    kwargs (choices, help) pass to add_argument."""
    return parser.add_argument("--device", type=device_argument,
                               default=default or default_device(), **kwargs)
