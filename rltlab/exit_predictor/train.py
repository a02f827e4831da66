"""Train N+k lookahead exit predictors on teacher-mode traces.

    python -m rltlab.exit_predictor.train --traces DIR --out DIR [--rounds 1] [--k 2]
        [--label argmax|kl|stage2] [--model linear|mlp] [--target-precision 0.95]

Per decision round N (each writes OUT/n{N}/, a checkpoint of rltlab.exit_predictor.model):
tokens are split by prompt id into train / calibration / test (no prompt in two splits); the
predictor is trained with class-balanced BCE (pos_weight = negatives / positives) through
accelerate (Accelerator(cpu=...), split_batches: the same script on one CPU or as DDP on
several ranks under `accelerate launch`; --batch-size is the GLOBAL batch, each of N ranks
gets 1/N of it, so N ranks take the same steps on the same samples as one process); on the
calibration split a temperature T is fitted (NLL of
sigmoid(logit / T)), then the smallest threshold whose precision reaches the target. The test
split gives precision, recall, AUC, the firing rate and the expected executed rounds
(N + k when it fires, else R) next to the trace oracle's. OUT/metrics.json summarizes all N.
Every rank computes the same metrics; rank 0 alone writes. An OUT/n{N}/ checkpoint trained on
the same traces (content digest) with the same settings is loaded instead of retrained
(resume; any world size), unless --no-resume.
"""
from __future__ import annotations

import argparse
import hashlib
import math
import os
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from rltlab.exit_predictor.features import (TRACE_FIELDS, label_spec, make_labels,
                                            oracle_rounds, trace_features)
from rltlab.exit_predictor.model import ExitPredictor, save_predictor


# ----------------------------------------------------------------------------- data

def load_training_data(trace_dir: str | os.PathLike, weight_version: int | None = None
                       ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Teacher-mode traces (verified) and their provenance: base model hash, hidden size, R,
    sha256 of the trace manifest. Refuses non-teacher traces, projected hidden states and
    traces of several weight versions (pick one with weight_version)."""
    from rltlab.traces import load_traces, read_manifest
    from rltlab.traces.sharded import content_digest

    root = Path(trace_dir)
    manifest = read_manifest(root)
    if not manifest.get("info", {}).get("teacher", False):
        raise ValueError(f"{root}: predictor labels need teacher-mode traces (every round "
                         "of every token); collect with teacher=True")
    if manifest.get("projection"):
        raise ValueError(f"{root}: traces store projected hidden states; the predictor needs "
                         "the full h_r (collect without projection_dim)")
    tr = load_traces(root, fields=TRACE_FIELDS)
    n = tr["executed"].shape[0]
    if n == 0:
        raise ValueError(f"{root} holds no traced tokens")
    R = manifest["num_rounds"]
    if not bool((tr["executed"] == R).all()):
        raise ValueError(f"{root}: some tokens did not run all {R} rounds")
    versions = sorted({int(v) for v in tr["weight_version"].tolist()})
    if weight_version is None:
        if len(versions) > 1:
            raise ValueError(f"{root} mixes weight versions {versions}; pass weight_version")
        weight_version = versions[0]
    keep = tr["weight_version"] == weight_version
    if not bool(keep.any()):
        raise ValueError(f"{root} has no tokens of weight version {weight_version}")
    tr = {k: v[keep] for k, v in tr.items()}
    hashes = manifest.get("info", {}).get("model_hashes", {})
    info = {"trace_dir": str(root.resolve()), "num_tokens": int(keep.sum()),
            "manifest_sha256": hashlib.sha256((root / "manifest.json").read_bytes()).hexdigest(),
            "content_sha256": manifest.get("content_sha256") or content_digest(manifest),
            "weight_version": int(weight_version),
            "model_hash": hashes.get(str(weight_version)),
            "hidden_size": int(manifest["hidden_dim"]), "num_rounds": int(R),
            "hidden_dtype": manifest["hidden_dtype"]}
    return tr, info


def split_by_prompt(prompt_ids: torch.Tensor, fractions: Sequence[float] = (0.7, 0.15, 0.15),
                    seed: int = 0) -> list[torch.Tensor]:
    """Boolean masks (train, calibration, test): whole prompts go to one split (seeded)."""
    uniq = torch.unique(prompt_ids)
    order = uniq[torch.randperm(len(uniq), generator=torch.Generator().manual_seed(seed))]
    cuts = np.cumsum([0] + [round(f * len(uniq)) for f in fractions[:-1]] + [len(uniq)])
    cuts = np.minimum(cuts, len(uniq))
    masks = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        masks.append(torch.isin(prompt_ids, order[lo:hi]))
    return masks


# ----------------------------------------------------------------------------- metrics

def roc_auc(scores: Sequence[float], labels: Sequence[float]) -> float:
    """Area under the ROC curve (Mann-Whitney, ties count one half); NaN with one class."""
    s, y = np.asarray(scores, float), np.asarray(labels, float) > 0.5
    pos, neg = int(y.sum()), int((~y).sum())
    if pos == 0 or neg == 0:
        return math.nan
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s))
    sorted_s = s[order]
    i = 0
    while i < len(s):           # average ranks over ties
        j = i
        while j + 1 < len(s) and sorted_s[j + 1] == sorted_s[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[y].sum() - pos * (pos + 1) / 2) / (pos * neg))


def binary_metrics(probs: torch.Tensor, labels: torch.Tensor, threshold: float
                   ) -> dict[str, float]:
    fire = probs >= threshold
    y = labels > 0.5
    tp, fp = int((fire & y).sum()), int((fire & ~y).sum())
    fn = int((~fire & y).sum())
    return {"tokens": int(len(y)), "label_rate": float(y.float().mean()) if len(y) else math.nan,
            "fire_rate": float(fire.float().mean()) if len(y) else math.nan,
            "precision": tp / (tp + fp) if tp + fp else math.nan,
            "recall": tp / (tp + fn) if tp + fn else math.nan,
            "auc": roc_auc(probs.tolist(), labels.tolist())}


def fit_temperature(logits: torch.Tensor, labels: torch.Tensor, steps: int = 200) -> float:
    """Temperature T > 0 minimizing the NLL of sigmoid(logit / T) (LBFGS on log T)."""
    if logits.numel() == 0 or labels.min() == labels.max():
        return 1.0
    log_t = torch.zeros(1, requires_grad=True)
    opt = torch.optim.LBFGS([log_t], lr=0.1, max_iter=steps)
    z, y = logits.detach().float(), labels.float()

    def closure():
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(z / log_t.exp(), y)
        loss.backward()
        return loss
    opt.step(closure)
    t = float(log_t.detach().exp())
    return t if math.isfinite(t) and t > 0 else 1.0


def choose_threshold(probs: torch.Tensor, labels: torch.Tensor, target_precision: float,
                     min_fires: int = 5) -> tuple[float, bool]:
    """Smallest threshold whose precision on (probs, labels) is >= target_precision with at
    least min_fires firing tokens: (threshold, reached). Not reachable -> (1.0, False)."""
    p, y = probs.double().numpy(), labels.numpy() > 0.5
    order = np.argsort(-p, kind="mergesort")
    tp = np.cumsum(y[order])
    count = np.arange(1, len(p) + 1)
    precision = tp / count
    ok = (precision >= target_precision) & (count >= min_fires)
    # a threshold equal to p[order[i]] fires every token with p >= it: only positions where
    # the next score differs are valid cut points
    distinct = np.r_[p[order][1:] != p[order][:-1], True] if len(p) else np.zeros(0, bool)
    ok &= distinct
    if not ok.any():
        return 1.0, False
    i = int(np.nonzero(ok)[0].max())
    return float(p[order][i]), True


def expected_rounds(fire: torch.Tensor, exit_round: int, num_rounds: int) -> float:
    """Mean executed rounds of the lookahead rule on traced tokens (N + k if fired, else R)."""
    return float(torch.where(fire, float(exit_round), float(num_rounds)).mean()) \
        if len(fire) else math.nan


# ----------------------------------------------------------------------------- training

def train_predictor(features: torch.Tensor, labels: torch.Tensor, *, kind: str = "linear",
                    hidden: int = 64, epochs: int = 30, lr: float = 3e-3, batch_size: int = 256,
                    weight_decay: float = 1e-4, seed: int = 0, cpu: bool | None = None,
                    progress: bool = False) -> tuple[ExitPredictor, dict[str, Any]]:
    """Class-balanced BCE training through accelerate (DDP under a launcher; batch_size is the
    global batch, split between the ranks). Returns (predictor on CPU, log)."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration
    from torch.utils.data import DataLoader, TensorDataset

    if cpu is None:
        cpu = not torch.cuda.is_available()
    torch.manual_seed(seed)
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
    predictor = accelerator.unwrap_model(predictor).cpu().eval()
    return predictor, {"epochs": epochs, "loss_first": losses[0] if losses else math.nan,
                       "loss_last": losses[-1] if losses else math.nan,
                       "pos_weight": float(pos_weight), "device": str(accelerator.device),
                       "num_processes": accelerator.num_processes}


@torch.no_grad()
def predict_logits(predictor: ExitPredictor, features: torch.Tensor) -> torch.Tensor:
    return predictor(features.float()) if len(features) else torch.zeros(0)


def train_from_traces(trace_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                      rounds: Sequence[int] = (1,), k: int = 2, label: str = "argmax",
                      eps: float = 0.1, margin: float = 0.005, kind: str = "linear",
                      hidden: int = 64, epochs: int = 30, lr: float = 3e-3,
                      batch_size: int = 256, target_precision: float = 0.95, seed: int = 0,
                      weight_version: int | None = None, cpu: bool | None = None,
                      progress: bool = False, resume: bool = True) -> dict[str, Any]:
    """Train, calibrate and evaluate one predictor per decision round N; writes (rank 0)
    OUT/n{N}/ checkpoints and OUT/metrics.json. Returns the metrics (on every rank)."""
    from rltlab.distributed import get_state
    from rltlab.exit_predictor.model import load_predictor, read_predictor_manifest
    from rltlab.runs import write_json_atomic

    if cpu is None:
        cpu = not torch.cuda.is_available()
    state = get_state("cpu" if cpu else "cuda")
    start = time.perf_counter()
    tr, info = load_training_data(trace_dir, weight_version)
    if info["model_hash"] is None:
        raise ValueError(f"{trace_dir}: the trace manifest records no model hash")
    R = info["num_rounds"]
    spec = label_spec(label, eps, margin)
    train_m, calib_m, test_m = split_by_prompt(tr["prompt_id"], seed=seed)
    oracle = oracle_rounds(tr)
    out = Path(out_dir)
    per_round = []
    for n in rounds:
        exit_round = n + k
        if not 1 <= n < R or exit_round > R:
            raise ValueError(f"decision round {n} with k={k} must satisfy 1 <= N < R and "
                             f"N + k <= R = {R}")
        x = trace_features(tr, n)
        y = make_labels(tr, exit_round, spec)
        training = {"kind": kind, "hidden": hidden, "epochs": epochs, "lr": lr,
                    "batch_size": batch_size, "seed": seed, "label": spec, "k": k,
                    "content_sha256": info["content_sha256"],
                    "weight_version": info["weight_version"]}
        ckpt = out / f"n{n}"
        if resume and (ckpt / "manifest.json").is_file() and \
                read_predictor_manifest(ckpt).get("training") == _jsonable(training):
            predictor, done = load_predictor(ckpt)
            log = {**done["train_log"], "resumed": True}
        else:
            predictor, log = train_predictor(x[train_m], y[train_m], kind=kind, hidden=hidden,
                                             epochs=epochs, lr=lr, batch_size=batch_size,
                                             seed=seed, cpu=cpu, progress=progress)
        logits = predict_logits(predictor, x)
        temperature = fit_temperature(logits[calib_m], y[calib_m])
        probs = torch.sigmoid(logits / temperature)
        threshold, reached = choose_threshold(probs[calib_m], y[calib_m], target_precision)
        test = binary_metrics(probs[test_m], y[test_m], threshold)
        fire_test = probs[test_m] >= threshold
        test.update({
            "expected_rounds": expected_rounds(fire_test, exit_round, R),
            "rounds_saved": R - expected_rounds(fire_test, exit_round, R),
            "label_ceiling_rounds": expected_rounds(y[test_m] > 0.5, exit_round, R),
            "oracle_rounds": float(oracle[test_m].float().mean()) if bool(test_m.any())
            else math.nan})
        calib = binary_metrics(probs[calib_m], y[calib_m], threshold)
        entry = {"decision_round": n, "k": k, "exit_round": exit_round,
                 "temperature": temperature, "threshold": threshold,
                 "target_precision": target_precision, "target_reached": reached,
                 "train": {**log, "tokens": int(train_m.sum()),
                           "label_rate": float(y[train_m].mean())},
                 "calibration": calib, "test": test}
        manifest = {
            "base_model_hash": info["model_hash"], "hidden_size": info["hidden_size"],
            "num_rounds": R, "decision_round": n, "k": k, "exit_round": exit_round,
            "label": spec, "features": {"hidden": f"h_{n}", "gate_logits": f"g_1..g_{n}",
                                        "stats": ["top1_prob", "margin", "entropy"],
                                        "dim": int(x.shape[1])},
            "temperature": temperature, "threshold": threshold,
            "target_precision": target_precision, "target_reached": reached,
            "training_data": {k2: info[k2] for k2 in ("trace_dir", "manifest_sha256",
                                                      "content_sha256", "num_tokens",
                                                      "weight_version", "hidden_dtype")},
            "training": training, "train_log": {k2: v for k2, v in log.items()
                                                if k2 != "resumed"},
            "split": {"by": "prompt_id", "fractions": [0.7, 0.15, 0.15], "seed": seed},
            "metrics": {"calibration": calib, "test": test}}
        if state.is_main_process and not log.get("resumed"):
            save_predictor(predictor, ckpt, manifest)
        state.wait_for_everyone()   # the checkpoint exists for every rank before any reads it
        entry["checkpoint"] = str(ckpt)
        per_round.append(entry)
    metrics = {"trace_dir": info["trace_dir"], "tokens": info["num_tokens"],
               "model_hash": info["model_hash"], "label": spec, "model_kind": kind,
               "split_tokens": {"train": int(train_m.sum()), "calibration": int(calib_m.sum()),
                                "test": int(test_m.sum())},
               "per_round": per_round, "seconds": round(time.perf_counter() - start, 2)}
    if state.is_main_process:
        write_json_atomic(out / "metrics.json", metrics)
    state.wait_for_everyone()
    return metrics


def _jsonable(obj: Any) -> Any:
    """obj as it reads back from a JSON manifest (tuples -> lists), for comparisons."""
    import json
    return json.loads(json.dumps(obj))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m rltlab.exit_predictor.train",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", required=True, help="teacher-mode trace directory")
    ap.add_argument("--out", required=True, help="output directory (OUT/n{N}/ checkpoints)")
    ap.add_argument("--rounds", type=int, nargs="+", default=[1], help="decision rounds N")
    ap.add_argument("--k", type=int, default=2, help="lookahead: exit at N + k")
    ap.add_argument("--label", default="argmax", choices=["argmax", "kl", "stage2"])
    ap.add_argument("--eps", type=float, default=0.1, help="KL bound of --label kl (nats)")
    ap.add_argument("--margin", type=float, default=0.005, help="--label stage2 margin (nats)")
    ap.add_argument("--model", default="linear", choices=["linear", "mlp"])
    ap.add_argument("--hidden", type=int, default=64, help="MLP width")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--target-precision", type=float, default=0.95)
    ap.add_argument("--weight-version", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--cpu", action="store_true", help="force the CPU even with GPUs")
    ap.add_argument("--no-resume", action="store_true",
                    help="retrain even when OUT/n{N} holds a matching checkpoint")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    metrics = train_from_traces(
        args.traces, args.out, rounds=args.rounds, k=args.k, label=args.label, eps=args.eps,
        margin=args.margin, kind=args.model, hidden=args.hidden, epochs=args.epochs,
        lr=args.lr, batch_size=args.batch_size, target_precision=args.target_precision,
        seed=args.seed, weight_version=args.weight_version, cpu=True if args.cpu else None,
        progress=True, resume=not args.no_resume)
    from accelerate import PartialState
    if not PartialState().is_main_process:   # the state train_from_traces set up
        return metrics
    for e in metrics["per_round"]:
        t = e["test"]
        print(f"N={e['decision_round']} -> exit {e['exit_round']}: T={e['temperature']:.3f} "
              f"thr={e['threshold']:.3f} (target precision {e['target_precision']}, reached "
              f"{e['target_reached']}) test precision={t['precision']:.3f} "
              f"recall={t['recall']:.3f} AUC={t['auc']:.3f} fire={t['fire_rate']:.3f} "
              f"rounds={t['expected_rounds']:.3f} (oracle {t['oracle_rounds']:.3f})")
    print(f"wrote {args.out}/metrics.json")
    return metrics


if __name__ == "__main__":
    main()
