"""Train N+k lookahead exit predictors on teacher-mode traces.

    python -m rltlab.exit_predictor.train --traces DIR --out DIR [--rounds 1] [--k 2]
        [--label argmax|kl|stage2|downstream] [--model linear|mlp] [--members 1]
        [--target-precision 0.95]

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

import torch

from rltlab.exit_predictor.calibration import (  # noqa: F401  (re-exported)
    binary_metrics, calibrate, choose_threshold, expected_rounds, fit_temperature, roc_auc,
    split_by_prompt)
from rltlab.exit_predictor.features import (DEFAULT_ROUND0_BLOCKS, LABEL_KINDS, TRACE_FIELDS,
                                            check_round0_blocks, label_spec, make_labels,
                                            oracle_rounds, trace_features,
                                            trace_round0_features)
from rltlab.exit_predictor.fit import predict_logits, train_predictor  # noqa: F401 (re-exported)
from rltlab.exit_predictor.model import check_members, save_predictor


# ----------------------------------------------------------------------------- data

def load_training_data(trace_dir: str | os.PathLike, weight_version: int | None = None
                       ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Teacher-mode traces (verified) and their provenance: base model hash, hidden size, R,
    sha256 of the trace manifest. Refuses non-teacher traces, projected hidden states and
    traces of several weight versions (pick one with weight_version)."""
    from rltlab.traces import load_traces, read_manifest
    from rltlab.traces.sharded import manifest_digest

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
            "content_sha256": manifest_digest(manifest),
            "weight_version": int(weight_version),
            "model_hash": hashes.get(str(weight_version)),
            "hidden_size": int(manifest["hidden_dim"]), "num_rounds": int(R),
            "hidden_dtype": manifest["hidden_dtype"]}
    return tr, info


# split_by_prompt, roc_auc, binary_metrics, fit_temperature, choose_threshold and
# expected_rounds live in rltlab.exit_predictor.calibration (re-exported here)


def train_from_traces(trace_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                      rounds: Sequence[int] = (1,), k: int = 2, label: str = "argmax",
                      eps: float = 0.1, margin: float = 0.005, window: int | None = None,
                      kind: str = "linear", members: int = 1,
                      hidden: int = 64, epochs: int = 30, lr: float = 3e-3,
                      batch_size: int = 256, target_precision: float = 0.95, seed: int = 0,
                      weight_version: int | None = None, cpu: bool | None = None,
                      progress: bool = False, resume: bool = True, model=None,
                      round0_features: Sequence[str] = DEFAULT_ROUND0_BLOCKS,
                      round0_prev_round: int | None = None) -> dict[str, Any]:
    """Train, calibrate and evaluate one predictor per decision round N; writes (rank 0)
    OUT/n{N}/ checkpoints and OUT/metrics.json. Returns the metrics (on every rank).
    N = 0 (decide before round 1 from features.ROUND0_BLOCKS) needs the base `model` (its
    embedding; its hash must equal the traces') and uses tokens of output index >= 2, plus
    output index 1 when the trace directory holds prefill states (data.PREFILL_FILE).
    round0_prev_round: which round of the previous traced position gives its state (default
    R; features.trace_round0_features)."""
    from rltlab.common.distributed import get_state
    from rltlab.exit_predictor.model import load_predictor, read_predictor_manifest
    from rltlab.common.atomic import write_json_atomic

    check_members(members)
    if cpu is None:
        cpu = not torch.cuda.is_available()
    state = get_state("cpu" if cpu else "cuda")
    start = time.perf_counter()
    tr, info = load_training_data(trace_dir, weight_version)
    if info["model_hash"] is None:
        raise ValueError(f"{trace_dir}: the trace manifest records no model hash")
    R = info["num_rounds"]
    spec = label_spec(label, eps, margin, window)
    train_m, calib_m, test_m = split_by_prompt(tr["prompt_id"], seed=seed)
    oracle = oracle_rounds(tr)
    prefill, prefill_digest = _prefill_states(trace_dir) if 0 in rounds else (None, None)
    out = Path(out_dir)
    per_round = []
    blocks = check_round0_blocks(round0_features)
    for n in rounds:
        exit_round = n + k
        if not 0 <= n < R or exit_round > R:
            raise ValueError(f"decision round {n} with k={k} must satisfy 0 <= N < R and "
                             f"N + k <= R = {R}")
        keep = torch.ones(len(oracle), dtype=torch.bool)
        if n == 0:
            x, keep = trace_round0_features(tr, _embedding(model, info), blocks, prefill,
                                            round0_prev_round)
        else:
            x = trace_features(tr, n)
        labelled, round_spec = _with_downstream(tr, trace_dir, exit_round, spec)
        y = make_labels(labelled, exit_round, round_spec)[keep]
        tr_m, ca_m, te_m, orc = train_m[keep], calib_m[keep], test_m[keep], oracle[keep]
        training = {"kind": kind, "hidden": hidden, "epochs": epochs, "lr": lr,
                    "batch_size": batch_size, "seed": seed, "label": round_spec, "k": k,
                    "content_sha256": info["content_sha256"],
                    "weight_version": info["weight_version"]}
        if members != 1:    # absent for one network: earlier checkpoints still resume
            training["members"] = members
        if n == 0:
            training["round0_features"] = list(blocks)
            if prefill is not None:   # output index 1 rows included (their prefill state)
                training["prefill_states"] = prefill_digest
            if round0_prev_round is not None:
                training["round0_prev_round"] = int(round0_prev_round)
        ckpt = out / f"n{n}"
        if resume and (ckpt / "manifest.json").is_file() and \
                read_predictor_manifest(ckpt).get("training") == _jsonable(training):
            predictor, done = load_predictor(ckpt)
            log = {**done["train_log"], "resumed": True}
        else:
            predictor, log = train_predictor(x[tr_m], y[tr_m], kind=kind, hidden=hidden,
                                             epochs=epochs, lr=lr, batch_size=batch_size,
                                             seed=seed, cpu=cpu, progress=progress,
                                             members=members)
        logits = predict_logits(predictor, x)
        temperature, probs, threshold, reached = calibrate(logits, y, ca_m, target_precision)
        test = binary_metrics(probs[te_m], y[te_m], threshold)
        fire_test = probs[te_m] >= threshold
        test.update({
            "expected_rounds": expected_rounds(fire_test, exit_round, R),
            "rounds_saved": R - expected_rounds(fire_test, exit_round, R),
            "label_ceiling_rounds": expected_rounds(y[te_m] > 0.5, exit_round, R),
            "oracle_rounds": float(orc[te_m].float().mean()) if bool(te_m.any())
            else math.nan})
        calib = binary_metrics(probs[ca_m], y[ca_m], threshold)
        entry = {"decision_round": n, "k": k, "exit_round": exit_round,
                 "temperature": temperature, "threshold": threshold,
                 "target_precision": target_precision, "target_reached": reached,
                 "train": {**log, "tokens": int(tr_m.sum()),
                           "label_rate": float(y[tr_m].mean())},
                 "calibration": calib, "test": test}
        manifest = {
            "base_model_hash": info["model_hash"], "hidden_size": info["hidden_size"],
            "num_rounds": R, "decision_round": n, "k": k, "exit_round": exit_round,
            "label": round_spec, "features": _feature_spec(n, blocks, int(x.shape[1]),
                                                     round0_prev_round or R),
            "temperature": temperature, "threshold": threshold,
            "target_precision": target_precision, "target_reached": reached,
            "training_data": {k2: info[k2] for k2 in ("trace_dir", "manifest_sha256",
                                                      "content_sha256", "num_tokens",
                                                      "weight_version", "hidden_dtype")},
            "rows_used": int(keep.sum()),
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


def _with_downstream(tr, trace_dir, exit_round: int, spec: dict[str, Any]):
    """(traces, label spec) for one exit round: with the downstream file's fields, and its
    mode and digest in the spec (the checkpoint manifest then names the labels used), when the
    label needs them."""
    if spec["kind"] != "downstream":
        return tr, spec
    from rltlab.exit_predictor.downstream import (attach_downstream, downstream_file,
                                                  read_downstream)

    _, meta = read_downstream(trace_dir, exit_round)
    digest = hashlib.sha256(downstream_file(trace_dir, exit_round).read_bytes()).hexdigest()
    return (attach_downstream(tr, trace_dir, exit_round),
            {**spec, "mode": meta.get("mode"), "file_sha256": digest})


def _feature_spec(n: int, blocks: Sequence[str], dim: int, prev_round: int = 0
                  ) -> dict[str, Any]:
    """The manifest's feature description (the engine policy builds its input from it)."""
    if n == 0:
        return {"set": "round0", "blocks": list(blocks), "embed": "embed(token t) = h_0",
                "prev_stats": ["top1_prob", "margin", "entropy"], "prev_source":
                f"the state the previous position exited from (in teacher traces: its "
                f"round {prev_round}; output index 1: the prefill's round R)",
                "dim": dim}
    return {"set": f"round{n}", "hidden": f"h_{n}", "gate_logits": f"g_1..g_{n}",
            "stats": ["top1_prob", "margin", "entropy"], "dim": dim}


def _embedding(model, info: dict[str, Any]) -> torch.Tensor:
    """The base model's token embedding [V, H] (fp32) after checking it made the traces."""
    from rltlab.model.checkpoint import model_hash
    if model is None:
        raise ValueError("decision round 0 needs the base model (its token embedding): pass "
                         "model= (CLI: --model-dir, default the embedded model)")
    if model_hash(model) != info["model_hash"]:
        raise ValueError(f"the model's hash {model_hash(model)!r} is not the traces' "
                         f"{info['model_hash']!r}: load the model the traces were made with")
    return model.model.embed_tokens.weight.detach().float().cpu()


def _prefill_states(trace_dir) -> tuple[dict[str, torch.Tensor] | None, str | None]:
    """The trace directory's prefill states (output index 1's previous state) and the
    sha256 of their file, or (None, None)."""
    from rltlab.exit_predictor.data import PREFILL_FILE, read_prefill_states

    states = read_prefill_states(trace_dir)
    if states is None:
        return None, None
    return states, hashlib.sha256((Path(trace_dir) / PREFILL_FILE).read_bytes()).hexdigest()


def _jsonable(obj: Any) -> Any:
    """obj as it reads back from a JSON manifest (tuples -> lists), for comparisons."""
    import json
    return json.loads(json.dumps(obj))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m rltlab.exit_predictor.train",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", required=True, help="teacher-mode trace directory")
    ap.add_argument("--out", required=True, help="output directory (OUT/n{N}/ checkpoints)")
    ap.add_argument("--rounds", type=int, nargs="+", default=[1],
                    help="decision rounds N (0: before round 1, needs the model)")
    ap.add_argument("--model-dir", default=None,
                    help="base model for N = 0 (its embedding); default: the embedded model")
    ap.add_argument("--round0-features", nargs="+", default=list(DEFAULT_ROUND0_BLOCKS),
                    help="N = 0 feature blocks out of embed, prev_stats, prev_hidden")
    ap.add_argument("--round0-prev-round", type=int, default=None,
                    help="N = 0: round of the previous traced position standing for the state "
                         "it exited from (default R)")
    ap.add_argument("--k", type=int, default=2, help="lookahead: exit at N + k")
    ap.add_argument("--label", default="argmax", choices=list(LABEL_KINDS))
    ap.add_argument("--eps", type=float, default=0.1, help="KL bound of --label kl (nats)")
    ap.add_argument("--margin", type=float, default=0.005, help="--label stage2 margin (nats)")
    ap.add_argument("--window", type=int, default=None,
                    help="--label downstream: later outputs checked (default: to the end)")
    ap.add_argument("--model", default="linear", choices=["linear", "mlp"])
    ap.add_argument("--hidden", type=int, default=64, help="MLP width")
    ap.add_argument("--members", type=int, default=1,
                    help="networks averaged into one predictor (seeds SEED, SEED + 1, ...)")
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
    model = None
    if 0 in args.rounds:
        from rltlab.model.checkpoint import load_model
        model = load_model(args.model_dir, threads=args.threads or 1)[0]
    metrics = train_from_traces(
        args.traces, args.out, rounds=args.rounds, k=args.k, label=args.label, eps=args.eps,
        window=args.window,
        margin=args.margin, kind=args.model, members=args.members, hidden=args.hidden,
        epochs=args.epochs,
        lr=args.lr, batch_size=args.batch_size, target_precision=args.target_precision,
        seed=args.seed, weight_version=args.weight_version, cpu=True if args.cpu else None,
        progress=True, resume=not args.no_resume, model=model,
        round0_features=args.round0_features, round0_prev_round=args.round0_prev_round)
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
    from rltlab.common.command import run_command
    from rltlab.common.distributed import shutdown

    run_command(main)
    shutdown()   # every rank tears its process group down before exit
