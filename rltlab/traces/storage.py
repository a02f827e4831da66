"""On-disk trace format: safetensors shards + a JSON manifest with sha256 checksums.

    <dir>/manifest.json           format, schema, rounds, hidden dim/dtype, projection, shards
    <dir>/shard-00000.safetensors one tensor per field, first axis = token
    <dir>/projection.safetensors  the fixed random projection matrix [H, D] (if any)

Every file is written to a temporary sibling, fsynced and renamed into place; the manifest is
rewritten (atomically) after each shard, so a killed collection leaves a valid dataset of the
shards finished so far. Readers check every shard's size and sha256 against the manifest
before using it: a truncated or corrupt shard raises TraceCorruptError naming it, and so does a
manifest that is not valid JSON or lacks a field (the message names the file and the field).
A writer holds an OS lock (flock on `.<manifest>.lock`) from its creation to close(): a second
writer of the same manifest gets TraceDirectoryLocked instead of corrupting it.

Fields per token (N tokens in a shard, R = rounds, D = stored hidden dim):

    hidden        [N, R, D]  h_r (after model.norm), storage dtype; zeros where not executed
    round_mask    [N, R]     bool: round r was executed (observed)
    gate_logit, hazard, cdf, top1_prob, margin, entropy, logprob_ref, kl_ref   [N, R] fp32
    top1_id       [N, R]     int32
    executed      [N]        int32: rounds executed (R in teacher mode)
    selected      [N]        int32: the policy's exit round (in teacher mode: what it would pick)
    ref_round     [N]        int32: round the ref statistics refer to (= executed)
    ref_token     [N]        int32: argmax at ref_round
    token         [N]        int32: the token actually emitted (-1 if the request did not finish)
    position      [N]        int32: input position of the token (prompt length P + i - 1)
    output_index  [N]        int32: index i of the output token its rounds produced (>= 1)
    prompt_id     [N]        int64
    sample_index  [N]        int32
    weight_version [N]       int64
    seed          [N]        int64: the sample's seed (SamplingParams.sample_seed)
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import struct
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import safetensors.torch
import torch
from torch.utils.data import IterableDataset, get_worker_info

from rltlab.common.atomic import write_bytes_atomic, write_json_atomic
# re-exported: storage is where readers and writers have always found these names
from rltlab.traces.manifest import (FORMAT, MANIFEST, SCHEMA_VERSION, TraceCorruptError,
                                    TraceDirectoryLocked, check_fields, lock_manifest,
                                    read_manifest, read_manifest_file)

PROJECTION_FILE = "projection.safetensors"
ROUND_FIELDS_F32 = ("gate_logit", "hazard", "cdf", "top1_prob", "margin", "entropy",
                    "logprob_ref", "kl_ref")
TOKEN_FIELDS_I32 = ("executed", "selected", "ref_round", "ref_token", "token", "position",
                    "output_index", "sample_index")
TOKEN_FIELDS_I64 = ("prompt_id", "weight_version", "seed")
ALL_FIELDS = ("hidden", "round_mask", "top1_id", *ROUND_FIELDS_F32, *TOKEN_FIELDS_I32,
              *TOKEN_FIELDS_I64)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while True:
            block = handle.read(chunk)
            if not block:
                break
            digest.update(block)
    return digest.hexdigest()


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]
                 ) -> tuple[str, int]:
    """Write the canonical safetensors file -> (its sha256, its size), from the bytes in
    memory (no second read of the file)."""
    data = safetensors.torch.save({k: v.contiguous() for k, v in tensors.items()},
                                  metadata=metadata)
    parts = _canonical_header(data)
    write_bytes_atomic(path, parts)
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return digest.hexdigest(), sum(len(part) for part in parts)


def _canonical_header(data: bytes) -> tuple[bytes, memoryview]:
    """The same safetensors file with its JSON header keys sorted. safetensors writes the
    metadata from a Rust HashMap, whose order changes from process to process, so equal shards
    would get different sha256s in different runs or ranks; data offsets are relative to the
    end of the header, so re-serializing it leaves the tensor bytes valid. -> (the new size
    and header, the tensor bytes as a view of data: no copy of them)."""
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)   # safetensors pads the header to 8 bytes with spaces
    return struct.pack("<Q", len(text)) + text, memoryview(data)[8 + size:]


def hidden_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"hidden dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class TraceWriter:
    """Accumulates per-token records and writes a shard every `shard_tokens` tokens.

    records: dicts holding every field of ALL_FIELDS for one token (tensors or numbers), or
    columns: every field of ALL_FIELDS as one tensor over tokens (add_columns; the same bytes).
    An existing directory with a manifest is appended to when its settings match.
    manifest_name: the manifest's file name; data-parallel ranks share one directory, each with
    its own manifest (rltlab.traces.sharded merges them into manifest.json).
    """

    def __init__(self, out_dir: str | os.PathLike, *, num_rounds: int, hidden_dim: int,
                 dtype: str | torch.dtype = "float32", shard_tokens: int = 4096,
                 projection: torch.Tensor | None = None, projection_seed: int | None = None,
                 info: dict[str, Any] | None = None, manifest_name: str = MANIFEST):
        self.dir = Path(out_dir)
        self.dtype = hidden_dtype(dtype)
        if shard_tokens < 1:
            raise ValueError("shard_tokens must be >= 1")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.manifest_path = self.dir / manifest_name
        self._lock = lock_manifest(self.dir, manifest_name)
        try:
            self._open(num_rounds, hidden_dim, shard_tokens, projection, projection_seed, info)
        except BaseException:
            self._release()
            raise

    def _open(self, num_rounds, hidden_dim, shard_tokens, projection, projection_seed, info):
        self.shard_tokens = shard_tokens
        self._pending: list[dict[str, torch.Tensor]] = []   # columns, in order
        self._pending_tokens = 0
        old = read_manifest_file(self.manifest_path) if self.manifest_path.exists() else None
        settings = {"num_rounds": num_rounds, "hidden_dim": hidden_dim,
                    "hidden_dtype": dtype_name(self.dtype)}
        if old is not None:
            clash = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
            if clash:
                raise ValueError(f"{self.dir} holds traces with other settings {clash}; "
                                 "use a new directory")
            self.manifest = old
        else:
            self.manifest = {"format": FORMAT, "schema_version": SCHEMA_VERSION, **settings,
                             "fields": list(ALL_FIELDS), "projection": None, "shards": [],
                             "num_tokens": 0, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                             "info": {}}
        if projection is not None and self.manifest["projection"] is None:
            path = self.dir / PROJECTION_FILE
            digest, size = _atomic_save({"projection": projection.float().cpu()}, path,
                                        {"format": "pt"})
            self.manifest["projection"] = {
                "file": PROJECTION_FILE, "in_dim": int(projection.shape[0]),
                "out_dim": int(projection.shape[1]), "seed": projection_seed,
                "sha256": digest, "bytes": size}
        self.manifest["info"].update(info or {})
        write_json_atomic(self.manifest_path, self.manifest)

    @property
    def num_tokens(self) -> int:
        return self.manifest["num_tokens"] + self._pending_tokens

    def add(self, records: Sequence[dict[str, Any]]) -> None:
        if records:
            self.add_columns(stack_records(list(records), self.dtype))

    def add_columns(self, columns: dict[str, torch.Tensor]) -> None:
        """Append tokens given as columns (field -> tensor, first axis = token)."""
        columns = typed_columns(columns, self.dtype)
        self._pending.append(columns)
        self._pending_tokens += len(columns["token"])
        while self._pending_tokens >= self.shard_tokens:
            self._write(self._take(self.shard_tokens))

    def _take(self, count: int) -> dict[str, torch.Tensor]:
        """The first `count` pending tokens as one set of columns (removed from pending)."""
        merged = concat_columns(self._pending)
        self._pending = [{k: v[count:] for k, v in merged.items()}] \
            if self._pending_tokens > count else []
        self._pending_tokens -= count
        return {k: v[:count] for k, v in merged.items()}

    def update_info(self, **info: Any) -> None:
        self._check_open()
        self.manifest["info"].update(info)
        write_json_atomic(self.manifest_path, self.manifest)

    def close(self) -> dict[str, Any]:
        """Write the pending records and release the directory (a second close does nothing)."""
        if self._lock is not None:
            try:
                if self._pending_tokens:
                    self._write(self._take(self._pending_tokens))
            finally:
                self._release()
        return self.manifest

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.close()   # closing the lock file drops the flock
            self._lock = None

    @property
    def closed(self) -> bool:
        return self._lock is None

    def _check_open(self) -> None:
        if self._lock is None:
            raise RuntimeError(f"the TraceWriter of {self.manifest_path} is closed")

    def write_group(self, records: Sequence[dict[str, Any]] | dict[str, torch.Tensor],
                    group: str) -> None:
        """Write `records` (in the given order; or columns) as their own shards
        `shard-<group>-<part>`, of at most shard_tokens tokens, apart from the pending ones. A
        shard's bytes then depend only on the group's records, not on what else this writer
        saw (data-parallel ranks reproduce a single process's shards exactly)."""
        if not group or "/" in group or group != group.strip():
            raise ValueError(f"bad shard group name {group!r}")
        if isinstance(records, dict):
            columns = typed_columns(records, self.dtype)
        else:
            records = list(records)
            columns = stack_records(records, self.dtype) if records else None
        count = len(columns["token"]) if columns is not None else 0
        for part, start in enumerate(range(0, count, self.shard_tokens)):
            self._write({k: v[start:start + self.shard_tokens] for k, v in columns.items()},
                        f"shard-{group}-{part:03d}.safetensors")

    def _write(self, tensors: dict[str, torch.Tensor], name: str | None = None) -> None:
        self._check_open()
        count = len(tensors["token"])
        name = name or f"shard-{len(self.manifest['shards']):05d}.safetensors"
        if any(entry["file"] == name for entry in self.manifest["shards"]):
            raise ValueError(f"{self.dir} already has a shard {name}")
        path = self.dir / name
        versions = sorted({int(v) for v in tensors["weight_version"].tolist()})
        meta = {"format": FORMAT, "schema_version": str(SCHEMA_VERSION),
                "weight_versions": json.dumps(versions),
                "model_hashes": json.dumps({str(v): self.manifest["info"].get(
                    "model_hashes", {}).get(str(v)) for v in versions})}
        digest, size = _atomic_save(tensors, path, meta)
        self.manifest["shards"].append({
            "file": name, "num_tokens": count, "bytes": size, "sha256": digest,
            "weight_versions": versions})
        self.manifest["num_tokens"] += count
        write_json_atomic(self.manifest_path, self.manifest)


def typed_columns(columns: dict[str, Any], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Columns (field -> values over tokens) as the shard tensors: every field of ALL_FIELDS
    in its storage dtype, on the CPU (a missing field or a token count that differs between
    fields raises ValueError)."""
    missing = [k for k in ALL_FIELDS if k not in columns]
    if missing:
        raise ValueError(f"trace columns lack the fields {missing}")
    out = {"hidden": torch.as_tensor(columns["hidden"]).cpu().to(dtype),
           "round_mask": torch.as_tensor(columns["round_mask"]).cpu().bool(),
           "top1_id": torch.as_tensor(columns["top1_id"]).cpu().int()}
    out.update({k: torch.as_tensor(columns[k]).cpu().float() for k in ROUND_FIELDS_F32})
    out.update({k: torch.as_tensor(columns[k]).cpu().to(torch.int32) for k in TOKEN_FIELDS_I32})
    out.update({k: torch.as_tensor(columns[k]).cpu().to(torch.int64) for k in TOKEN_FIELDS_I64})
    counts = {k: v.shape[0] if v.dim() else None for k, v in out.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(f"trace columns hold different token counts: {counts}")
    return out


def concat_columns(parts: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Columns of several batches of tokens, in order, as one."""
    if len(parts) == 1:
        return dict(parts[0])
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def stack_records(records: list[dict[str, Any]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {"hidden": torch.stack([torch.as_tensor(r["hidden"]) for r in records]).to(dtype),
           "round_mask": torch.stack([torch.as_tensor(r["round_mask"]) for r in records]).bool(),
           "top1_id": torch.stack([torch.as_tensor(r["top1_id"]) for r in records]).int()}
    for name in ROUND_FIELDS_F32:
        out[name] = torch.stack([torch.as_tensor(r[name]) for r in records]).float()
    for name in TOKEN_FIELDS_I32:
        out[name] = torch.tensor([int(r[name]) for r in records], dtype=torch.int32)
    for name in TOKEN_FIELDS_I64:
        out[name] = torch.tensor([int(r[name]) for r in records], dtype=torch.int64)
    return out


# ----------------------------------------------------------------------------- reading

def load_shard(root: str | os.PathLike, entry: dict[str, Any], verify: bool = True
               ) -> dict[str, torch.Tensor]:
    """One shard's tensors after checking its size and sha256 against the manifest entry."""
    path = Path(root) / entry["file"]
    if Path(entry["file"]).name != entry["file"]:
        raise TraceCorruptError(f"manifest names a shard outside the directory: {entry['file']}")
    if not path.is_file():
        raise TraceCorruptError(f"trace shard {path} is missing")
    data = path.read_bytes()
    if verify:
        if len(data) != entry["bytes"]:
            raise TraceCorruptError(
                f"trace shard {path} has {len(data)} bytes, the manifest says {entry['bytes']}"
                f" ({'truncated' if len(data) < entry['bytes'] else 'extra bytes'})")
        actual = hashlib.sha256(data).hexdigest()
        if actual != entry["sha256"]:
            raise TraceCorruptError(f"trace shard {path} fails its sha256 check (manifest "
                                    f"{entry['sha256'][:16]}..., file {actual[:16]}...): corrupt")
    try:
        tensors = safetensors.torch.load(data)
    except Exception as err:
        raise TraceCorruptError(f"trace shard {path} is not readable safetensors: {err}") from err
    n = entry["num_tokens"]
    bad = [k for k, v in tensors.items() if v.shape[0] != n]
    if bad:
        raise TraceCorruptError(f"trace shard {path}: fields {bad} do not hold {n} tokens")
    return tensors


def load_projection(root: str | os.PathLike, verify: bool = True) -> torch.Tensor | None:
    manifest = read_manifest(root)
    proj = manifest.get("projection")
    if not proj:
        return None
    entry = {"file": proj["file"], "bytes": proj["bytes"], "sha256": proj["sha256"],
             "num_tokens": proj["in_dim"]}
    return load_shard(root, entry, verify)["projection"]


def iter_shards(root: str | os.PathLike, fields: Sequence[str] | None = None,
                verify: bool = True) -> Iterator[dict[str, torch.Tensor]]:
    manifest = read_manifest(root)
    check_fields(fields, manifest)
    for entry in manifest["shards"]:
        tensors = load_shard(root, entry, verify)
        yield {k: v for k, v in tensors.items() if fields is None or k in fields}


def load_traces(root: str | os.PathLike, fields: Sequence[str] | None = None,
                verify: bool = True) -> dict[str, torch.Tensor]:
    """Every shard concatenated (verified): field -> tensor with all tokens on axis 0. An
    unknown name in `fields` raises ValueError naming it and the available fields."""
    parts: dict[str, list[torch.Tensor]] = {}
    for shard in iter_shards(root, fields, verify):
        for k, v in shard.items():
            parts.setdefault(k, []).append(v)
    if not parts:
        manifest = read_manifest(root)
        r = manifest["num_rounds"]
        return {k: torch.zeros((0, r)) for k in (fields or ())}
    return {k: torch.cat(v) for k, v in parts.items()}


def verify_traces(root: str | os.PathLike) -> dict[str, Any]:
    """Check every shard (size, sha256, readable, token counts); returns a summary."""
    manifest = read_manifest(root)
    total = 0
    for entry in manifest["shards"]:
        total += load_shard(root, entry, True)["token"].shape[0]
    if manifest.get("projection"):
        load_projection(root)
    if total != manifest["num_tokens"]:
        raise TraceCorruptError(f"{root}: shards hold {total} tokens, the manifest says "
                                f"{manifest['num_tokens']}")
    return {"shards": len(manifest["shards"]), "num_tokens": total}


class TraceDataset(IterableDataset):
    """Streams per-token examples (dicts of tensors) from a trace directory, shard by shard.

    Each shard is verified (size + sha256) when it is opened; a corrupt or truncated shard
    raises TraceCorruptError. With several DataLoader workers the shards are split between
    them. shuffle=True shuffles the shard order and the tokens inside each shard (seeded;
    call set_epoch(k) for a new order per epoch).
    """

    def __init__(self, root: str | os.PathLike, fields: Sequence[str] | None = None,
                 shuffle: bool = False, seed: int = 0, verify: bool = True):
        super().__init__()
        self.root, self.fields, self.shuffle, self.seed, self.verify = (
            Path(root), tuple(fields) if fields else None, shuffle, seed, verify)
        self.manifest = read_manifest(self.root)
        check_fields(self.fields, self.manifest)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return int(self.manifest["num_tokens"])

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        shards = list(self.manifest["shards"])
        rng = random.Random(self.seed * 1_000_003 + self.epoch)
        if self.shuffle:
            rng.shuffle(shards)
        worker = get_worker_info()
        if worker is not None:
            shards = shards[worker.id::worker.num_workers]
        for entry in shards:
            tensors = load_shard(self.root, entry, self.verify)
            if self.fields:
                tensors = {k: tensors[k] for k in self.fields}
            n = entry["num_tokens"]
            order = list(range(n))
            if self.shuffle:
                rng.shuffle(order)
            for i in order:
                yield {k: v[i] for k, v in tensors.items()}
