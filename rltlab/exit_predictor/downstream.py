"""Downstream-aware exit labels: does exiting a token early change any later token?

    python -m rltlab.exit_predictor.downstream --traces DIR [--exit-round 3]
        [--mode greedy|single] [--threads 1]

The argmax and KL labels (features.make_labels) judge a token by its own round-t output. Under
LAST_EXITED a token that exits at round t also hands its round-t K/V to every deeper plane, so
later tokens read a different context. This module measures that effect in teacher forcing:
for every traced decode token it reruns the traced sequence with that position exiting at
`exit_round` (model(ids, exit_rounds=...), LAST_EXITED) and records the first later output
whose argmax changes. Mode "single": every other position at full depth. Mode "greedy"
(default): the exits accumulate left to right, each token rerun with the earlier tokens that
passed already exiting (sequence_greedy), as a policy that exits many tokens would run.

Written to DIR/downstream_r{t}.safetensors (atomically), one row per traced token:

    prompt_id, sample_index, output_index    the trace row's key
    own_ok       bool   the position's own round-t argmax equals the full-depth one
    first_flip   int32  0 = no later output changes; d >= 1 = the d-th later output is the
                        first whose argmax changes (teacher forcing on the traced tokens)

features.make_labels(kind="downstream", window=W) turns these into labels: own_ok and no flip
within the next W outputs (W None: to the end of the sequence). The sequences are rebuilt from
the trace directory's prompts (exit_predictor.data.training_prompts: problem ids 0.., text ids
TEXT_ID_BASE..) and traced tokens; the traces must be greedy (temperature 0) and the full-depth
rerun must reproduce at least 99% of the traced tokens, or the module refuses (sampled
traces, other prompts or another model). Labels compare against the rerun.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from rltlab.common.atomic import write_bytes_atomic

KEY_FIELDS = ("prompt_id", "sample_index", "output_index")


def downstream_file(trace_dir: str | Path, exit_round: int) -> Path:
    return Path(trace_dir) / f"downstream_r{exit_round}.safetensors"


def traces_digest(trace_dir: str | Path) -> str:
    """The trace directory's content digest (its manifest's, or computed from the shards)."""
    from rltlab.traces import read_manifest
    from rltlab.traces.sharded import manifest_digest

    return manifest_digest(read_manifest(trace_dir))


def _branch(model, prefix_cache, batch: int, prefix_len: int):
    """A fresh cache of `batch` rows holding prefix_cache's first prefix_len positions (the
    full-depth prompt every rerun of a sequence shares)."""
    from rltlab.model.architecture import LoopedKVCache

    branch = LoopedKVCache(model.config, batch, prefix_cache.max_len, prefix_cache.k.dtype,
                           prefix_cache.k.device)
    branch.k[..., :prefix_len, :] = prefix_cache.k[..., :prefix_len, :]
    branch.v[..., :prefix_len, :] = prefix_cache.v[..., :prefix_len, :]
    branch.key_mask[:, :prefix_len] = True
    branch.length = prefix_len
    return branch


def _prefix(model, prompt: Sequence[int], decoded: Sequence[int]):
    """(cache holding the prompt at full depth, the decode inputs o_0..o_{n-1} [1, n]): o_0 is
    the full-depth prefill's greedy token, output i's input is o_{i-1}."""
    from rltlab.model.architecture import LoopedKVCache

    if len(decoded) < 1 or len(prompt) < 1:
        raise ValueError("a traced sequence needs a prompt and at least one decode output")
    param = next(model.parameters())
    cache = LoopedKVCache(model.config, 1, len(prompt) + len(decoded), param.dtype,
                          param.device)
    first = model(torch.tensor([list(prompt)], device=param.device),
                  cache=cache).final_logits[0, -1].argmax()
    rest = torch.tensor(list(decoded[:-1]), dtype=first.dtype, device=param.device)
    return cache, torch.cat([first[None], rest])[None]


@torch.no_grad()
def sequence_flips(model, prompt: Sequence[int], decoded: Sequence[int], exit_round: int,
                   batch_size: int = 64) -> tuple[torch.Tensor, torch.Tensor, int]:
    """own_ok [n], first_flip [n] (module doc) of the decode outputs o_1..o_n = `decoded`, and
    how many of them the full-depth rerun does not reproduce (near-ties; the labels compare
    against the rerun). Output i's input is o_{i-1}, at position len(prompt) + i - 1."""
    cache, suffix = _prefix(model, prompt, decoded)
    n, P, R = len(decoded), len(prompt), model.config.num_rounds
    # row 0: every position at full depth (the reference); row 1 + j: input P + j exits early
    rows = torch.full((n + 1, n), R, dtype=torch.long, device=suffix.device)
    rows[torch.arange(1, n + 1), torch.arange(n)] = exit_round
    top = []
    for s in range(0, n + 1, batch_size):
        part = rows[s:s + batch_size]
        out = model(suffix.expand(len(part), -1), exit_rounds=part,
                    cache=_branch(model, cache, len(part), P))
        top.append(out.final_logits.argmax(-1).cpu())
    top = torch.cat(top)                                   # [n + 1, n]: argmax per input
    mismatches = int((top[0] != torch.tensor(list(decoded))).sum())
    changed = top[1:] != top[0:1]                          # [n, n]: variant j, output i
    dist = torch.arange(n)[None, :] - torch.arange(n)[:, None]
    later = torch.where(torch.triu(changed, diagonal=1), dist, torch.full_like(dist, n + 1))
    first_flip = later.min(dim=1).values
    first_flip = torch.where(first_flip > n, torch.zeros_like(first_flip), first_flip)
    return ~changed.diagonal(), first_flip.to(torch.int32), mismatches


@torch.no_grad()
def sequence_greedy(model, prompt: Sequence[int], decoded: Sequence[int], exit_round: int
                    ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Like sequence_flips, but exits accumulate left to right: output j joins the early-exit
    set E when exiting it too (E + {j}) changes no output from j on; its own_ok / first_flip
    are measured with E's exits in place. The label then answers "is this exit safe given the
    earlier ones a policy took?" (the single-exit label ignores how exits compound)."""
    cache, suffix = _prefix(model, prompt, decoded)
    n, P, R = len(decoded), len(prompt), model.config.num_rounds

    def argmax_with(exits: torch.Tensor) -> torch.Tensor:
        rounds = torch.where(exits, exit_round, R)[None]
        out = model(suffix, exit_rounds=rounds, cache=_branch(model, cache, 1, P))
        return out.final_logits[0].argmax(-1).cpu()

    exits = torch.zeros(n, dtype=torch.bool, device=suffix.device)
    reference = argmax_with(exits)
    mismatches = int((reference != torch.tensor(list(decoded))).sum())
    own_ok = torch.zeros(n, dtype=torch.bool)
    first_flip = torch.zeros(n, dtype=torch.int32)
    for j in range(n):
        trial = exits.clone()
        trial[j] = True
        changed = argmax_with(trial) != reference
        own_ok[j] = not bool(changed[j])
        later = changed[j + 1:].nonzero()
        first_flip[j] = int(later[0]) + 1 if len(later) else 0
        if own_ok[j] and first_flip[j] == 0:
            exits = trial
    return own_ok, first_flip, mismatches


MODES = {"single": sequence_flips, "greedy": sequence_greedy}


def data_prompts(tokenizer, prompt_ids: torch.Tensor, seed: int) -> dict[int, list[int]]:
    """The prompts exit_predictor.data traced (problem ids 0..A-1, text ids TEXT_ID_BASE..)."""
    from rltlab.exit_predictor.data import TEXT_ID_BASE, training_prompts

    if tokenizer is None:
        raise ValueError("rebuilding exit_predictor.data's prompts needs its tokenizer")
    pids = sorted(set(prompt_ids.tolist()))
    arith = sum(p < TEXT_ID_BASE for p in pids)
    text = len(pids) - arith
    if pids != list(range(arith)) + [TEXT_ID_BASE + i for i in range(text)]:
        raise ValueError("prompt ids are not 0..A-1 and TEXT_ID_BASE..: traces not written by "
                         "rltlab.exit_predictor.data; pass the prompts")
    prompts, ids = training_prompts(tokenizer, arith=arith, text=text, seed=seed)
    return dict(zip(ids, prompts))


def compute_downstream(model, trace_dir: str | Path, *,
                       prompts: Mapping[int, Sequence[int]] | None = None, tokenizer=None,
                       exit_round: int = 3, mode: str = "greedy", progress: bool = True
                       ) -> dict[str, Any]:
    """Measure every traced sequence (module doc) and write downstream_file(trace_dir,
    exit_round) atomically; returns a summary (rates, mismatches, seconds). prompts maps each
    prompt id to its token ids; None rebuilds exit_predictor.data's prompts with tokenizer."""
    import time

    from safetensors.torch import save
    from tqdm.auto import tqdm

    from rltlab.model.checkpoint import model_hash
    from rltlab.traces import load_traces, read_manifest

    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    manifest = read_manifest(trace_dir)
    R = int(manifest["num_rounds"])
    if not 1 <= exit_round < R:
        raise ValueError(f"exit round must lie in [1, {R - 1}], got {exit_round}")
    if not manifest.get("info", {}).get("teacher", False):
        raise ValueError(f"{trace_dir}: downstream labels need teacher-mode traces")
    hashes, this = set(manifest["info"].get("model_hashes", {}).values()), model_hash(model)
    if hashes != {this}:
        raise ValueError(f"{trace_dir}: traced with model(s) {sorted(hashes)}, not this model "
                         f"({this})")
    tr = load_traces(trace_dir, fields=list(KEY_FIELDS) + ["token"])
    if prompts is None:
        prompts = data_prompts(tokenizer, tr["prompt_id"], int(manifest["info"].get("seed", 0)))
    missing = set(tr["prompt_id"].tolist()) - set(prompts)
    if missing:
        raise ValueError(f"no prompt given for traced prompt ids {sorted(missing)[:5]}")
    fn = MODES[mode]
    own_ok = torch.zeros(len(tr["token"]), dtype=torch.bool)
    first_flip = torch.zeros(len(tr["token"]), dtype=torch.int32)
    mismatches, start = 0, time.perf_counter()
    sequences: dict[tuple[int, int], list[int]] = {}
    for row, key in enumerate(zip(tr["prompt_id"].tolist(), tr["sample_index"].tolist())):
        sequences.setdefault(key, []).append(row)
    for (pid, sample), rows in tqdm(sequences.items(), desc=f"downstream r{exit_round} "
                                    f"({mode})", disable=not progress):
        rows = torch.tensor(rows)
        rows = rows[tr["output_index"][rows].argsort()]
        index = tr["output_index"][rows]
        if not torch.equal(index, torch.arange(1, len(rows) + 1, dtype=index.dtype)):
            raise ValueError(f"{trace_dir}: prompt {pid} sample {sample}: output indices are "
                             "not 1..n")
        own, flip, bad = fn(model, prompts[pid], tr["token"][rows].tolist(), exit_round)
        own_ok[rows], first_flip[rows] = own, flip
        mismatches += bad
    if mismatches > 0.01 * len(own_ok):
        raise ValueError(f"the full-depth rerun differs from the traces on {mismatches} of "
                         f"{len(own_ok)} tokens: sampled (temperature > 0) traces, or other "
                         "prompts")
    tensors = {k: tr[k].to(torch.int64).contiguous() for k in KEY_FIELDS}
    tensors.update(own_ok=own_ok, first_flip=first_flip)
    write_bytes_atomic(downstream_file(trace_dir, exit_round), save(tensors, metadata={
        "mode": mode, "exit_round": str(exit_round),
        "content_sha256": traces_digest(trace_dir)}))
    safe = own_ok & (first_flip == 0)
    return {"file": str(downstream_file(trace_dir, exit_round)), "mode": mode,
            "exit_round": exit_round, "tokens": len(own_ok),
            "own_ok_rate": float(own_ok.float().mean()),
            "downstream_ok_rate": float(safe.float().mean()),
            "flipped_rate": float((own_ok & (first_flip > 0)).float().mean()),
            "rerun_mismatches": mismatches,
            "seconds": round(time.perf_counter() - start, 1)}


def read_downstream(trace_dir: str | Path, exit_round: int) -> tuple[dict[str, torch.Tensor],
                                                                      dict[str, str]]:
    """The tensors and metadata of downstream_file(trace_dir, exit_round)."""
    from safetensors import safe_open

    path = downstream_file(trace_dir, exit_round)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run python -m "
                                f"rltlab.exit_predictor.downstream --traces {trace_dir} "
                                f"--exit-round {exit_round}")
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def attach_downstream(traces: Mapping[str, torch.Tensor], trace_dir: str | Path,
                      exit_round: int) -> dict[str, torch.Tensor]:
    """traces plus downstream_own_ok / downstream_first_flip aligned to its rows (by
    prompt id, sample index, output index; every row must be covered) and the exit round they
    measure (downstream_exit_round)."""
    stored, meta = read_downstream(trace_dir, exit_round)
    if meta.get("content_sha256") != traces_digest(trace_dir):
        raise ValueError(f"{downstream_file(trace_dir, exit_round)} was computed for other "
                         "traces (content_sha256 differs): recompute it")
    row_of = {key: i for i, key in enumerate(zip(*(stored[k].tolist() for k in KEY_FIELDS)))}
    rows = [row_of.get(key, -1) for key in zip(*(traces[k].tolist() for k in KEY_FIELDS))]
    if -1 in rows:
        raise ValueError(f"{downstream_file(trace_dir, exit_round)} does not cover every "
                         "traced token: recompute it for this trace directory")
    rows = torch.tensor(rows, dtype=torch.long)
    return {**traces, "downstream_own_ok": stored["own_ok"][rows],
            "downstream_first_flip": stored["first_flip"][rows],
            "downstream_exit_round": torch.tensor(exit_round)}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m rltlab.exit_predictor.downstream")
    ap.add_argument("--traces", required=True, help="teacher-mode trace directory "
                    "(python -m rltlab.exit_predictor.data)")
    ap.add_argument("--model-dir", default=None, help="default: the embedded model")
    ap.add_argument("--exit-round", type=int, default=3)
    ap.add_argument("--mode", default="greedy", choices=sorted(MODES))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    from rltlab.model.checkpoint import load_model

    model, tokenizer, _ = load_model(args.model_dir, threads=args.threads)
    summary = compute_downstream(model, args.traces, tokenizer=tokenizer,
                                 exit_round=args.exit_round, mode=args.mode)
    import json
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    from rltlab.common.command import run_command

    run_command(main)
