"""Versioned, atomic weight updates.

Lifecycle: start(version) -> update(chunk) ... -> finish(). The version must exceed the one
being served (versions never go backwards). Each chunk is validated as a whole (known name, no
duplicate, same shape, floating dtype, finite values, no overflow when cast) and then STAGED: a
private copy in the parameter's dtype and on its device, so the sender may reuse its tensors at
once. Nothing reaches the model before finish(), which checks that every parameter was sent and
then copies all staged tensors in place with param.data.copy_ (same storage, so captured CUDA
graphs stay valid). So an update is all or nothing: a rejected chunk, or finish() with
parameters never sent, abandons the update (the staged tensors are dropped) and the previous
version keeps serving; an update that is started and never finished changes nothing either.
Staging holds up to one extra copy of the weights until finish().
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn


class WeightUpdateError(ValueError):
    pass


class WeightUpdater:
    READY, UPDATING = "ready", "updating"

    def __init__(self, model: nn.Module, version: int = 0):
        if not _is_int(version):
            raise WeightUpdateError(f"weight version must be an int, got {version!r}")
        self.params = dict(model.named_parameters())
        self.version = version
        self.state = self.READY
        self.target_version: int | None = None
        self.staged: dict[str, torch.Tensor] = {}
        self.error: str | None = None   # why the last update was abandoned

    def start(self, version: int) -> None:
        """Begin an update to `version` (> the served version). A start during an unfinished
        update drops that update's staged chunks."""
        if not _is_int(version):
            raise WeightUpdateError(f"weight version must be an int, got {version!r}")
        if version <= self.version:
            raise WeightUpdateError(f"weight version {version} does not exceed the served "
                                    f"version {self.version}: versions only increase")
        self.state, self.target_version, self.staged, self.error = \
            self.UPDATING, version, {}, None

    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Validate then stage one chunk; returns how many tensors it held."""
        self._check_updating("update_weights()")
        chunk = list(named_tensors)
        try:
            self._validate(chunk)
            staged = {name: self._stage(name, tensor) for name, tensor in chunk}
        except WeightUpdateError as err:
            raise self._abandon(str(err)) from err
        self.staged.update(staged)
        return len(chunk)

    def finish(self) -> int:
        """Apply every staged tensor at once; -> the new version."""
        self._check_updating("finish_weight_update()")
        missing = sorted(set(self.params) - set(self.staged))
        if missing:
            raise self._abandon(f"update to version {self.target_version} finished with "
                                f"{len(missing)} of {len(self.params)} parameters missing: "
                                f"{_names(missing)}")
        with torch.no_grad():
            for name, tensor in self.staged.items():
                self.params[name].data.copy_(tensor)
        self.state, self.version, self.staged = self.READY, self.target_version, {}
        return self.version

    def _check_updating(self, call: str) -> None:
        if self.state == self.UPDATING:
            return
        why = (f" (the update to version {self.target_version} was abandoned: {self.error})"
               if self.error else "")
        raise RuntimeError(f"{call} without an update in progress{why}; version "
                           f"{self.version} is serving: call start_weight_update(version) first")

    def _abandon(self, why: str) -> WeightUpdateError:
        """Drop the staged chunks; -> the error to raise (it says what keeps serving)."""
        self.state, self.staged, self.error = self.READY, {}, why
        return WeightUpdateError(f"{why}; the update to version {self.target_version} is "
                                 f"abandoned and version {self.version} keeps serving")

    def _stage(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        param = self.params[name]
        staged = tensor.detach().to(device=param.device, dtype=param.dtype, copy=True)
        if tensor.dtype != param.dtype and not bool(torch.isfinite(staged).all()):
            raise WeightUpdateError(f"{name}: overflows when cast {tensor.dtype} -> "
                                    f"{param.dtype}")
        return staged

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


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _names(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... (+{len(names) - limit})" if len(names) > limit else "")
