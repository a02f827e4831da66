"""A pretraining run's resumable state: the seeded batch order and atomic state saves."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch


class BatchOrder:
    """Row indices of step s: a fresh seeded permutation per epoch, so any step is reproducible."""

    def __init__(self, n_rows, batch, seed):
        self.n, self.batch, self.seed, self.perms = n_rows, batch, seed, {}

    def __call__(self, step):
        pos = torch.arange(step * self.batch, (step + 1) * self.batch)
        out = torch.empty_like(pos)
        for epoch in pos.div(self.n, rounding_mode="floor").unique().tolist():
            if epoch not in self.perms:
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self.perms = {epoch: torch.randperm(self.n, generator=gen)}
            sel = pos // self.n == epoch
            out[sel] = self.perms[epoch][pos[sel] % self.n]
        return out


def save_state(state_dir: Path, payload: dict, log_path: Path, log: list) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    torch.save(payload, state_dir / "state.pt.tmp")
    os.replace(state_dir / "state.pt.tmp", state_dir / "state.pt")  # atomic
    log_path.with_suffix(".tmp").write_text("".join(json.dumps(r) + "\n" for r in log))
    os.replace(log_path.with_suffix(".tmp"), log_path)


def resume_state(state_dir: Path, config: dict, runtime_keys: set, objects: dict, device):
    """(step, steps, log) from state_dir/state.pt, loading `objects` (name -> module/optimizer)
    in place; (0, config["steps"], []) when there is none. Refuses a state of another config."""
    if not (state_dir / "state.pt").is_file():
        return 0, config["steps"], []
    state = torch.load(state_dir / "state.pt", map_location=device, weights_only=False)
    diff = {k for k in config if k not in runtime_keys | {"steps"}
            and config[k] != state["config"].get(k)}
    if diff or (config["steps"] and config["steps"] != state["steps"]):
        raise ValueError(f"{state_dir} was written by another config (differs in "
                         f"{sorted(diff) or ['steps']}); use another out_dir")
    for name, obj in objects.items():
        obj.load_state_dict(state[name])
    print(f"resumed from {state_dir} at step {state['step']}", flush=True)
    return state["step"], state["steps"], state["log"]
