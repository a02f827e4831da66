"""A checkpointed, resumable, data-parallel draft-component training run, and its CLI.

    python -m rltlab.draft_heads.run --out DIR [--kind lora_lm_head --steps 150 ...]
    accelerate launch --multi_gpu --num_processes 2 -m rltlab.workbench.scale train-draft
        --out DIR ...

The distillation itself is rltlab.draft_heads.train (distill, distill_features); this module
adds the run around it: rank-0 atomic saves, resume when a finished checkpoint has the same
settings (model hash, row digests, hyper-parameters), and the command line.
"""
from __future__ import annotations

import time

import torch

from rltlab.common.device import add_device_argument
from rltlab.draft_heads.train import distill, evaluate, training_rows
from rltlab.model.architecture import OuroForCausalLM


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes (the identity of the training rows)."""
    import hashlib
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _params_digest(params) -> str:
    import hashlib
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train_component(model: OuroForCausalLM, rows: torch.Tensor, heldout: torch.Tensor,
                    out_dir, *, kind: str = "residual_mlp", draft_rounds: int = 1,
                    component_args: dict | None = None, steps: int = 150,
                    batch_size: int = 16, lr: float = 1e-3, seed: int = 0,
                    log_every: int | None = None, precompute: bool = True,
                    resume: bool = True, state=None, log_fn=None) -> tuple:
    """Distil a `kind` component (data parallel over `state`'s ranks, see `distill`) and write
    it to out_dir: rank 0 alone saves it (save_component: weights, then the metadata with
    the training settings, train log and held-out metrics) and OUT/metrics.json, with barriers
    around the writes. Resume: a finished component in out_dir (metadata and weight digests
    intact) whose metadata records the same settings (kind, d, component config, steps, batch,
    lr, seed, base model hash, digests of the training and held-out rows) is loaded instead of
    retrained, whatever world size wrote it; rank 0 decides and tells the others.
    Returns (component, metrics), the same on every rank; metrics["heldout"] is
    `evaluate(model, component, heldout)`, "ranks_in_sync" whether every rank ended with the
    same adapter parameters, "writers" the ranks that wrote a checkpoint."""
    from pathlib import Path

    from rltlab.model.checkpoint import model_hash
    from rltlab.draft_heads.heads import build_component, component_files_ok, save_component
    from rltlab.engine_patches.loop_draft import load_draft_component, read_metadata
    from rltlab.common.atomic import _jsonable, write_json_atomic

    world = 1 if state is None else state.num_processes
    main = state is None or state.is_main_process
    started = time.perf_counter()
    out = Path(out_dir)
    log_every = log_every or max(1, steps // 5)
    training = _jsonable({
        "kind": kind, "draft_rounds": draft_rounds, "component": dict(component_args or {}),
        "steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed,
        "log_every": log_every, "precompute": precompute, "base_model_hash": model_hash(model),
        "rows_sha256": tensor_digest(rows), "heldout_sha256": tensor_digest(heldout)})
    resumed = bool(main and resume and component_files_ok(out)
                   and read_metadata(out).get("training") == training)
    if world > 1:
        from accelerate.utils import broadcast_object_list
        resumed = broadcast_object_list([resumed])[0]     # rank 0's decision, on every rank
    device = next(model.parameters()).device
    if resumed:
        component = load_draft_component(out, model, draft_rounds).to(device)
        log = read_metadata(out)["train_log"]
    else:
        torch.manual_seed(seed)
        component = build_component(kind, model, draft_rounds, **(component_args or {}))
        component = component.to(device)
        log = distill(model, component, rows, steps=steps, batch_size=batch_size, lr=lr,
                      seed=seed, log_every=log_every, heldout=heldout, log_fn=log_fn,
                      precompute=precompute, state=state)
    component.eval()
    heldout_metrics = evaluate(model, component, heldout)
    digests = [_params_digest(component.adapter_parameters())]
    if world > 1:
        from accelerate.utils import gather_object
        digests = gather_object(digests)
        state.wait_for_everyone()       # every rank has read out_dir before rank 0 writes
    wrote = []
    if main and not resumed:
        save_component(component, model, out, {"training": training, "train_log": log,
                                                "heldout": heldout_metrics,
                                                "num_processes": world})
        wrote = [0 if state is None else state.process_index]
    if world > 1:
        wrote = gather_object(wrote)
    metrics = {"kind": kind, "draft_rounds": draft_rounds, "component_dir": str(out),
               "num_processes": world, "resumed": resumed, "training": training,
               "train_log": log, "heldout": heldout_metrics, "params_sha256": digests[0],
               "ranks_in_sync": len(set(digests)) == 1, "writers": wrote,
               "seconds": round(time.perf_counter() - started, 3)}
    if main:
        write_json_atomic(out / "metrics.json", metrics)
    if world > 1:
        state.wait_for_everyone()       # the checkpoint exists for every rank on return
    return component, metrics


def add_train_args(ap) -> None:
    """The arguments of a draft-head training run (this module's CLI and `rltlab.workbench.scale
    train-draft`)."""
    from rltlab.draft_heads.heads import KINDS

    ap.add_argument("--out", required=True, help="component directory (draft_component.json, "
                    "weights, metrics.json)")
    ap.add_argument("--model", default=None, help="model dir (default: the embedded model)")
    ap.add_argument("--kind", default="residual_mlp", choices=sorted(KINDS))
    ap.add_argument("--draft-rounds", type=int, default=1, help="d: rounds the draft runs")
    ap.add_argument("--r", type=int, default=None, help="LoRA rank (LoRA kinds)")
    ap.add_argument("--inner", type=int, default=None, help="residual_mlp inner width")
    ap.add_argument("--train-rows", type=int, default=192)
    ap.add_argument("--heldout-rows", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--data-seed", type=int, default=0,
                    help="training rows' seed (held-out rows: data seed + 1)")
    ap.add_argument("--steps", type=int, default=150, help="optimizer steps")
    ap.add_argument("--batch-size", type=int, default=16,
                    help="GLOBAL batch of rows per step (each of N ranks trains on 1/N)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0, help="init and row-pick seed")
    ap.add_argument("--log-every", type=int, default=None, help="default: steps // 5")
    ap.add_argument("--no-precompute", action="store_true",
                    help="teacher forward every step (reuse-exact kinds precompute it once)")
    add_device_argument(ap, choices=["cuda", "cpu"],
                        help="cuda: each rank uses cuda:LOCAL_RANK")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads per rank (CPU default: cores / local ranks)")
    ap.add_argument("--no-resume", action="store_true",
                    help="retrain even when OUT holds a finished component of these settings")
    ap.add_argument("--result", default=None, help="rank 0 writes the metrics JSON here too")


def run_train(args) -> dict:
    """A draft-head training run from parsed `add_train_args` arguments, as one process or as
    every rank under `accelerate launch` (rltlab.common.distributed.get_state). -> metrics."""
    from rltlab.common import distributed as dist
    from rltlab.model.checkpoint import load_model

    state = dist.get_state(args.device)
    threads = dist.configure_threads(args.threads, args.device)
    model, tokenizer, model_dir = load_model(args.model, dtype=args.dtype,
                                               device=str(state.device))
    rows = training_rows(tokenizer, args.train_rows, args.seq_len, seed=args.data_seed)
    heldout = training_rows(tokenizer, args.heldout_rows, args.seq_len, seed=args.data_seed + 1)
    component_args = {k: v for k, v in (("r", args.r), ("inner", args.inner)) if v is not None}

    def show(row):
        print({k: round(v, 4) for k, v in row.items()}, flush=True)
    _, metrics = train_component(
        model, rows.to(state.device), heldout.to(state.device), args.out, kind=args.kind,
        draft_rounds=args.draft_rounds, component_args=component_args, steps=args.steps,
        batch_size=args.batch_size, lr=args.lr, seed=args.seed, log_every=args.log_every,
        precompute=not args.no_precompute, resume=not args.no_resume, state=state,
        log_fn=show if state.is_main_process else None)
    metrics.update(command="train-draft", model_dir=str(model_dir), device=str(state.device),
                   threads_per_rank=threads)
    if state.is_main_process:
        if args.result:
            from rltlab.common.atomic import write_json_atomic
            write_json_atomic(args.result, metrics)
        print(f"{args.kind} d={args.draft_rounds} on {state.num_processes} process(es)"
              f"{' (resumed)' if metrics['resumed'] else ''}: held-out "
              f"{ {k: round(v, 4) for k, v in metrics['heldout'].items()} } -> {args.out}")
    return metrics


def main(argv=None) -> dict:
    import argparse
    ap = argparse.ArgumentParser(
        prog="python -m rltlab.draft_heads.run",
        description="Distil a loop-aware draft component on the frozen model; one process or "
                    "N ranks under `accelerate launch` (see docs/scale_out.md).")
    add_train_args(ap)
    return run_train(ap.parse_args(argv))


if __name__ == "__main__":
    from rltlab.common.command import run_command
    from rltlab.common.distributed import shutdown

    run_command(main)
    shutdown()   # every rank tears its process group down before exit
