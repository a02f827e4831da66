"""Data-parallel trace collection: every rank traces its blocks of prompts, rank 0 merges.

    outputs, manifest = collect_sharded(llm, prompts, params, out_dir, block=64, teacher=True)

Runs the same under `accelerate launch --num_processes N` and as one plain process. Prompts
are cut into blocks of `block` consecutive global prompt ids; block b goes to rank b % N
(rltlab.common.distributed.shard_blocks) and is one `generate` call on an idle engine whose records
are written, sorted by (prompt id, sample, position), as the shards `shard-w<b>-<part>`. Each
rank keeps its own manifest, `manifest-rank<r>.json` (the rank is in the manifest's name, the
block in the shards' names, so no two ranks ever write the same file); after a barrier rank 0
merges them into `manifest.json` with the shards sorted by name, i.e. by global prompt id.

A block's batch is the same whatever N, so its shard files are byte-identical to a single
process's: the merged manifest lists the same files, sizes and sha256 checksums, and its
`content_sha256` (a digest over what the traces are, leaving out when and by how many ranks
they were collected) is equal. Per-request seeds come from the base seed and the GLOBAL prompt
id (rltlab.common.distributed.prompt_seed), never from the rank.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any, Sequence

from rltlab.common.distributed import gather_indexed, get_state, prompt_seed, shard_blocks
from rltlab.common.atomic import write_json_atomic
from rltlab.traces.manifest import MANIFEST, read_manifest, read_manifest_file

RANK_MANIFEST = "manifest-rank{rank:05d}.json"
# info keys that describe a collection run (timings, ranks), not the traces themselves
RUN_INFO_KEYS = ("collection_stats", "distributed")
_SETTINGS = ("format", "schema_version", "num_rounds", "hidden_dim", "hidden_dtype", "fields",
             "projection")


def content_digest(manifest: dict[str, Any]) -> str:
    """sha256 over what a trace directory holds: settings, fields, projection, every shard's
    name / tokens / bytes / sha256 / weight versions, the token count and the info (teacher
    flag, model hashes) without RUN_INFO_KEYS and without the creation time."""
    body = {k: v for k, v in manifest.items() if k not in ("created", "content_sha256", "info")}
    body["info"] = {k: v for k, v in manifest.get("info", {}).items() if k not in RUN_INFO_KEYS}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def manifest_digest(manifest: dict[str, Any]) -> str:
    """The digest a manifest records (merged directories), else content_digest of it."""
    return manifest.get("content_sha256") or content_digest(manifest)


def sharded_params(params, prompt_ids: Sequence[int]) -> list:
    """One SamplingParams per prompt, seeded from (params.seed, global prompt id); a list is
    taken as given (the caller owns the seeds)."""
    from rltlab.engine import SamplingParams

    if not isinstance(params, SamplingParams):
        params = list(params)
        if len(params) != len(prompt_ids):
            raise ValueError(f"{len(params)} sampling params for {len(prompt_ids)} prompts")
        return params
    if params.seed is None:
        raise ValueError("sharded collection needs SamplingParams.seed: per-prompt seeds derive "
                         "from it and the global prompt id, so any world size samples the same")
    return [dataclasses.replace(params, seed=prompt_seed(params.seed, pid)) for pid in prompt_ids]


def collect_sharded(llm, prompts: Sequence[Sequence[int]], params, out_dir: str | Path, *,
                    block: int = 64, prompt_ids: Sequence[int] | None = None, state=None,
                    progress: bool = False, **collector_kwargs) -> tuple[list, dict[str, Any]]:
    """Trace `prompts` across the ranks of `state` (default: accelerate's PartialState).

    Returns, on every rank, (the RequestOutputs of ALL prompts in input order, the merged
    manifest). out_dir must not hold traces yet (a collection is not appended to).
    collector_kwargs go to TraceCollector (teacher, hidden_dtype, shard_tokens, ...).
    """
    from rltlab.traces.collect import TraceCollector

    engine = getattr(llm, "llm_engine", llm)
    if state is None:
        state = get_state(engine.runner.device.type)
    out = Path(out_dir)
    ids = list(range(len(prompts))) if prompt_ids is None else [int(i) for i in prompt_ids]
    if len(ids) != len(prompts) or len(set(ids)) != len(ids):
        raise ValueError("prompt_ids must give one distinct id per prompt")
    params_list = sharded_params(params, ids)
    stale = [p.name for p in out.glob("manifest*.json")] if out.is_dir() else []
    state.wait_for_everyone()   # every rank looks before any rank writes its manifest
    if stale:
        raise ValueError(f"{out} already holds traces ({', '.join(sorted(stale))}); "
                         "use a new directory")
    rank, world = state.process_index, state.num_processes
    collector = TraceCollector(llm, out, manifest_name=RANK_MANIFEST.format(rank=rank),
                               **collector_kwargs)
    blocks = shard_blocks(len(prompts), block, world, rank)
    if progress and state.is_main_process:
        from tqdm.auto import tqdm
        blocks = tqdm(blocks, desc=f"collect (rank 0 of {world})", unit="block")
    pairs = []
    try:
        for blk in blocks:
            outs = collector.generate([prompts[i] for i in blk], [params_list[i] for i in blk],
                                      [ids[i] for i in blk],
                                      shard_group=f"w{blk.start // block:05d}")
            pairs += list(zip(blk, outs))
    finally:
        collector.close()
    outputs = gather_indexed(state, pairs, len(prompts))
    state.wait_for_everyone()
    if state.is_main_process:
        merge_rank_manifests(out, world)
    state.wait_for_everyone()
    return outputs, read_manifest(out)


def merge_rank_manifests(out_dir: str | Path, world: int) -> dict[str, Any]:
    """manifest-rank*.json of `world` ranks -> manifest.json (atomic); the rank manifests are
    removed once the merged one is in place. Raises when the ranks disagree on the settings,
    a shard is listed twice or a weight version has two model hashes."""
    out = Path(out_dir)
    parts = []
    for rank in range(world):
        path = out / RANK_MANIFEST.format(rank=rank)
        if not path.is_file():
            raise FileNotFoundError(f"rank {rank} left no {path.name} in {out}")
        manifest = read_manifest_file(path)
        parts.append(manifest)
    first = parts[0]
    for rank, manifest in enumerate(parts[1:], 1):
        clash = [k for k in _SETTINGS if manifest.get(k) != first.get(k)]
        if clash:
            raise ValueError(f"rank {rank} traced with other settings than rank 0: {clash}")
    shards = sorted((e for m in parts for e in m["shards"]), key=lambda e: e["file"])
    names = [e["file"] for e in shards]
    if len(set(names)) != len(names):
        raise ValueError(f"{out}: a shard is listed by two ranks")
    hashes: dict[str, str] = {}
    for manifest in parts:
        for version, digest in manifest["info"].get("model_hashes", {}).items():
            if hashes.setdefault(version, digest) != digest:
                raise ValueError(f"weight version {version} has two model hashes across ranks")
    stats = [m["info"].get("collection_stats", {}) for m in parts]
    info = {k: v for k, v in first["info"].items() if k not in RUN_INFO_KEYS}
    info.update(model_hashes=dict(sorted(hashes.items())), collection_stats={
        "tokens": sum(s.get("tokens", 0) for s in stats),
        "requests": sum(s.get("requests", 0) for s in stats),
        "observe_s": round(sum(s.get("observe_s", 0.0) for s in stats), 4),
        "generate_s": round(max((s.get("generate_s", 0.0) for s in stats), default=0.0), 4)},
        distributed={"num_processes": world, "ranks": [
            {"rank": r, "shards": [e["file"] for e in m["shards"]], **stats[r]}
            for r, m in enumerate(parts)]})
    merged = {**{k: first[k] for k in _SETTINGS}, "shards": shards,
              "num_tokens": sum(e["num_tokens"] for e in shards),
              "created": first.get("created", time.strftime("%Y-%m-%dT%H:%M:%S")), "info": info}
    merged["content_sha256"] = content_digest(merged)
    write_json_atomic(out / MANIFEST, merged)
    for rank in range(world):
        (out / RANK_MANIFEST.format(rank=rank)).unlink()
    return merged
