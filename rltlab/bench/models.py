"""The bench commands' model options: a checkpoint (--model) or a random-weight preset."""
from __future__ import annotations

import argparse

import torch

from rltlab.common.device import add_device_argument
from rltlab.model.architecture import OuroForCausalLM
from rltlab.model.presets import PRESETS, preset_config, random_model


def add_model_arguments(ap: argparse.ArgumentParser) -> None:
    """--model/--preset/--device/--dtype: what build_model reads (shared by the bench commands)."""
    ap.add_argument("--model", help="checkpoint directory (default: a random --preset model)")
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    add_device_argument(ap)
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16")


def build_model(args) -> OuroForCausalLM:
    """The model args name: args.model (a checkpoint) or a random args.preset, on args.device
    in args.dtype (None: bfloat16 on CUDA, float32 elsewhere)."""
    from rltlab.common.device import default_dtype
    dtype = getattr(torch, args.dtype) if args.dtype else default_dtype(torch.device(args.device))
    if args.model:
        from rltlab.model.checkpoint import from_pretrained
        return from_pretrained(args.model, dtype=dtype, device=args.device)
    return random_model(preset_config(args.preset), args.device, dtype)
