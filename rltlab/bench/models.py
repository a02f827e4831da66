"""The bench commands' model options: a checkpoint (--model) or a random-weight preset."""
from __future__ import annotations

import argparse

import torch

from rltlab.common.device import add_device_argument
from rltlab.model.architecture import OuroForCausalLM
from rltlab.model.presets import PRESETS, preset_config, random_model


def _positive(text: str, what: str) -> float:
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite {what.split(' ', 1)[1]} > 0, "
                                         f"got {text}")
    return value


def positive_gib(text: str) -> float:
    """argparse type of --kv-gib: a finite number of GiB > 0 (a usage error otherwise)."""
    return _positive(text, "a number of GiB")


def positive_scale(text: str) -> float:
    """argparse type of the benches' --scale: a finite factor > 0 (a usage error otherwise;
    the scaled sizes are then floored at their minimums, as scaled() says)."""
    return _positive(text, "a factor")


def add_kv_argument(ap: argparse.ArgumentParser) -> None:
    """--kv-gib (args.kv_gib, None: the engine sizes its pool itself), shared by the closed-loop
    benches."""
    ap.add_argument("--kv-gib", type=positive_gib, default=None,
                    help="KV cache GiB per engine (default: sized from free GPU memory, as "
                         "LLM(...) does; 2 GiB off CUDA)")


def add_model_arguments(ap: argparse.ArgumentParser) -> None:
    """--model/--preset/--device/--dtype: what build_model reads (shared by the bench commands)."""
    ap.add_argument("--model", help="checkpoint directory (default: a random --preset model)")
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS),
                    help="the random-weight model's shape when no --model (default: small)")
    add_device_argument(ap)
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="model dtype (default: bfloat16 on CUDA, float32 elsewhere)")


def build_model(args) -> OuroForCausalLM:
    """The model args name: args.model (a checkpoint) or a random args.preset, on args.device
    in args.dtype (None: bfloat16 on CUDA, float32 elsewhere)."""
    from rltlab.common.device import default_dtype
    dtype = getattr(torch, args.dtype) if args.dtype else default_dtype(torch.device(args.device))
    if args.model:
        from rltlab.model.checkpoint import from_pretrained
        return from_pretrained(args.model, dtype=dtype, device=args.device)
    return random_model(preset_config(args.preset), args.device, dtype)
