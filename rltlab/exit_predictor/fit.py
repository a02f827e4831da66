"""Fitting one exit predictor to features and labels: class-balanced BCE through accelerate
(DDP under a launcher), optionally several seeds averaged into one (ExitPredictor.ensemble).
exit_predictor.train builds the features and labels from traces and calibrates the result."""
from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.nn.functional as F

from rltlab.exit_predictor.model import ExitPredictor, check_members


def train_predictor(features: torch.Tensor, labels: torch.Tensor, *, kind: str = "linear",
                    hidden: int = 64, epochs: int = 30, lr: float = 3e-3, batch_size: int = 256,
                    weight_decay: float = 1e-4, seed: int = 0, cpu: bool | None = None,
                    progress: bool = False, members: int = 1
                    ) -> tuple[ExitPredictor, dict[str, Any]]:
    """Class-balanced BCE training through accelerate (DDP under a launcher; batch_size is the
    global batch, split between the ranks). Returns (predictor on CPU, log: losses, device,
    parameters, seconds, peak_mem_gib = torch.cuda.max_memory_allocated there, else None).
    members > 1: that
    many networks, seeds seed, seed + 1, ..., each trained alone, then averaged (ExitPredictor
    .ensemble)."""
    check_members(members)
    if members > 1:
        parts = [train_predictor(features, labels, kind=kind, hidden=hidden, epochs=epochs,
                                 lr=lr, batch_size=batch_size, weight_decay=weight_decay,
                                 seed=seed + i, cpu=cpu, progress=progress)
                 for i in range(members)]
        logs = [log for _, log in parts]
        ensemble = ExitPredictor.ensemble([p for p, _ in parts])
        return ensemble, {
            **logs[0], "members": members,
            "parameters": sum(p.numel() for p in ensemble.parameters()),
            "seconds": round(sum(log["seconds"] for log in logs), 3),
            "loss_first": [log["loss_first"] for log in logs],
            "loss_last": [log["loss_last"] for log in logs]}
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration
    from torch.utils.data import DataLoader, TensorDataset

    if cpu is None:
        cpu = not torch.cuda.is_available()
    torch.manual_seed(seed)
    started = time.perf_counter()
    accelerator = Accelerator(cpu=cpu, dataloader_config=DataLoaderConfiguration(
        split_batches=True))
    if batch_size % accelerator.num_processes:
        raise ValueError(f"batch_size {batch_size} is not divisible by the "
                         f"{accelerator.num_processes} processes")
    features, labels = features.float(), labels.float()
    predictor = ExitPredictor(features.shape[1], kind, hidden)
    predictor.set_normalization(features)
    pos = float(labels.sum())
    neg = float(len(labels) - pos)
    pos_weight = torch.tensor(neg / pos if pos > 0 and neg > 0 else 1.0)
    loader = DataLoader(TensorDataset(features, labels), batch_size=batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(seed))
    opt = torch.optim.AdamW(predictor.parameters(), lr=lr, weight_decay=weight_decay)
    predictor, opt, loader = accelerator.prepare(predictor, opt, loader)
    pos_weight = pos_weight.to(accelerator.device)
    epochs_iter = range(epochs)
    if progress and accelerator.is_local_main_process:
        from tqdm.auto import tqdm
        epochs_iter = tqdm(epochs_iter, desc=f"train {kind}", unit="epoch")
    losses = []
    predictor.train()
    for _ in epochs_iter:
        sums = torch.zeros(2, device=accelerator.device)   # loss * samples, samples
        for x, y in loader:
            opt.zero_grad()
            loss = F.binary_cross_entropy_with_logits(predictor(x), y, pos_weight=pos_weight)
            accelerator.backward(loss)
            opt.step()
            sums += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)),
                                                                      device=sums.device)])
        sums = accelerator.reduce(sums, "sum")   # the epoch loss over every rank's samples
        losses.append(float(sums[0] / sums[1].clamp_min(1)))
        if hasattr(epochs_iter, "set_postfix"):
            epochs_iter.set_postfix(loss=f"{losses[-1]:.4f}")
    device = accelerator.device
    peak = (torch.cuda.max_memory_allocated(device) / 2 ** 30
            if torch.device(device).type == "cuda" else None)
    predictor = accelerator.unwrap_model(predictor).cpu().eval()
    return predictor, {"epochs": epochs, "loss_first": losses[0] if losses else math.nan,
                       "loss_last": losses[-1] if losses else math.nan,
                       "pos_weight": float(pos_weight), "device": str(device),
                       "num_processes": accelerator.num_processes,
                       "parameters": sum(p.numel() for p in predictor.parameters()),
                       "in_dim": int(features.shape[1]), "train_tokens": int(len(labels)),
                       "seconds": round(time.perf_counter() - started, 3),
                       "peak_mem_gib": peak}


@torch.no_grad()
def predict_logits(predictor: ExitPredictor, features: torch.Tensor) -> torch.Tensor:
    return predictor(features.float()) if len(features) else torch.zeros(0)
