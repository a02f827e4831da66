"""Versioned in-place weight updates.

Lifecycle: start(version) -> update(chunk) ... -> finish(). Each chunk is validated as a whole
(known name, no duplicate, same shape, floating dtype, finite values) before any parameter is
touched; accepted tensors are copied in place with param.data.copy_ (same storage, so captured
CUDA graphs stay valid; dtype/device are converted by the copy). A rejected chunk, or finish()
with parameters that were never sent, marks the update failed: the engine then refuses to
generate until a complete update succeeds.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn


class WeightUpdateError(ValueError):
    pass


class WeightUpdater:
    READY, UPDATING, FAILED = "ready", "updating", "failed"

    def __init__(self, model: nn.Module, version: int = 0):
        self.params = dict(model.named_parameters())
        self.version = version
        self.state = self.READY
        self.target_version: int | None = None
        self.received: set[str] = set()
        self.error: str | None = None

    def start(self, version: int) -> None:
        if not isinstance(version, int) or isinstance(version, bool):
            raise WeightUpdateError(f"weight version must be an int, got {version!r}")
        self.state, self.target_version, self.received, self.error = \
            self.UPDATING, version, set(), None

    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Validate then copy one chunk; returns how many tensors it held."""
        if self.state != self.UPDATING:
            raise RuntimeError("update_weights() outside an update: call "
                               "start_weight_update(version) first")
        chunk = list(named_tensors)
        try:
            self._validate(chunk)
        except WeightUpdateError as err:
            self._fail(str(err))
            raise
        with torch.no_grad():
            for name, tensor in chunk:
                self.params[name].data.copy_(tensor)
        self.received.update(name for name, _ in chunk)
        return len(chunk)

    def finish(self) -> int:
        if self.state != self.UPDATING:
            raise RuntimeError(f"finish_weight_update() without an update in progress "
                               f"(state {self.state})")
        missing = sorted(set(self.params) - self.received)
        if missing:
            self._fail(f"update to version {self.target_version} finished with {len(missing)} "
                       f"of {len(self.params)} parameters missing: {_names(missing)}")
            raise WeightUpdateError(self.error)
        self.state, self.version = self.READY, self.target_version
        return self.version

    def check_ready(self) -> None:
        if self.state == self.UPDATING:
            raise RuntimeError(f"weight update to version {self.target_version} in progress: "
                               "finish_weight_update() before generating")
        if self.state == self.FAILED:
            raise RuntimeError(f"the last weight update failed ({self.error}); the weights are "
                               "inconsistent, so generation is refused until a complete "
                               "update (start/update/finish) succeeds")

    def _fail(self, why: str) -> None:
        self.state, self.error = self.FAILED, why

    def _validate(self, chunk: list) -> None:
        seen: set[str] = set()
        for item in chunk:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise WeightUpdateError(f"weight chunks hold (name, tensor) pairs, got {item!r}")
            name, tensor = item
            if name not in self.params:
                raise WeightUpdateError(f"unknown parameter name {name!r}")
            if name in seen:
                raise WeightUpdateError(f"parameter {name!r} appears twice in one chunk")
            seen.add(name)
            param = self.params[name]
            if not isinstance(tensor, torch.Tensor):
                raise WeightUpdateError(f"{name}: expected a tensor, got {type(tensor).__name__}")
            if tuple(tensor.shape) != tuple(param.shape):
                raise WeightUpdateError(f"{name}: shape {tuple(tensor.shape)} != parameter "
                                        f"shape {tuple(param.shape)}")
            if not tensor.is_floating_point():
                raise WeightUpdateError(f"{name}: dtype {tensor.dtype} is not floating point")
            if not bool(torch.isfinite(tensor).all()):
                raise WeightUpdateError(f"{name}: holds NaN or Inf values")
            if tensor.dtype != param.dtype and not bool(torch.isfinite(
                    tensor.to(param.dtype)).all()):
                raise WeightUpdateError(f"{name}: overflows when cast {tensor.dtype} -> "
                                        f"{param.dtype}")


def _names(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... (+{len(names) - limit})" if len(names) > limit else "")
