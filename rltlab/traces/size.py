"""How many bytes a trace collection writes, said before it starts, and the refusal of one that
would fill the disk.

Per traced token (R rounds, D stored hidden dims, b bytes per hidden element):

    hidden                        R * D * b
    round_mask (bool), top1_id (int32) and 8 fp32 statistics per round     R * (1 + 4 + 32)
    8 int32 and 3 int64 per-token fields                                      56

plus, per shard, its safetensors header (~1.6 KB) and its manifest entry, the manifest itself
and the projection matrix (when there is one). At Ouro-1.4B's shape (R = 4, D = 2,048) in
bfloat16 a token is 16,384 + 204 bytes: the hidden states are 99% of it.
"""
from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from typing import Any

STAT_BYTES_PER_ROUND = 1 + 4 + 8 * 4      # round_mask, top1_id, 8 fp32 statistics
TOKEN_BYTES = 8 * 4 + 3 * 8               # int32 and int64 per-token fields
SHARD_OVERHEAD_BYTES = 8 + 1700 + 256     # safetensors length + header, manifest entry
MANIFEST_BYTES = 1024
DISK_RESERVE_BYTES = 256 * 2 ** 20        # left free on the file system after a collection
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


class NotEnoughDiskSpace(RuntimeError):
    """A collection whose traces would not fit the free disk space (refused before it starts)."""


def trace_bytes(num_tokens: int, *, num_rounds: int, hidden_dim: int,
                hidden_dtype: str = "bfloat16", shard_tokens: int = 4096,
                projection: tuple[int, int] | None = None) -> dict[str, Any]:
    """The bytes a trace directory of num_tokens tokens takes (module docstring): hidden,
    the rest (statistics, per-token fields, headers, manifest, projection) and their total."""
    if hidden_dtype not in _ITEMSIZE:
        raise ValueError(f"hidden dtype must be one of {sorted(_ITEMSIZE)}, got {hidden_dtype!r}")
    hidden = num_tokens * num_rounds * hidden_dim * _ITEMSIZE[hidden_dtype]
    shards = math.ceil(num_tokens / shard_tokens) if num_tokens else 0
    rest = (num_tokens * (num_rounds * STAT_BYTES_PER_ROUND + TOKEN_BYTES)
            + shards * SHARD_OVERHEAD_BYTES + MANIFEST_BYTES
            + (projection[0] * projection[1] * 4 + 256 if projection else 0))
    return {"tokens": int(num_tokens), "rounds": int(num_rounds), "hidden_dim": int(hidden_dim),
            "hidden_dtype": hidden_dtype, "hidden_bytes": int(hidden), "other_bytes": int(rest),
            "bytes": int(hidden + rest), "shards": shards}


def written_bytes(trace_dir: str | os.PathLike) -> int:
    """Bytes of the files a trace directory holds (shards, manifest, projection, side files)."""
    return sum(p.stat().st_size for p in Path(trace_dir).iterdir()
               if p.is_file() and not p.name.startswith("."))


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes (shutil.disk_usage) of the file system that holds `path` (or would: its
    nearest existing ancestor)."""
    path = Path(path).resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def describe(plan: dict[str, Any]) -> str:
    """One line: tokens x rounds x hidden x bytes = hidden GiB + the rest = total."""
    item = _ITEMSIZE[plan["hidden_dtype"]]
    return (f"{plan['tokens']:,} tokens x {plan['rounds']} rounds x {plan['hidden_dim']:,} "
            f"hidden x {item} bytes ({plan['hidden_dtype']}) = "
            f"{plan['hidden_bytes'] / 2 ** 30:.3f} GiB + {plan['other_bytes'] / 2 ** 30:.3f} GiB "
            f"of statistics and files = {plan['bytes'] / 2 ** 30:.3f} GiB in "
            f"{plan['shards']} shard(s)")


def check_disk(directory: str | os.PathLike, plan: dict[str, Any],
               reserve: int = DISK_RESERVE_BYTES) -> dict[str, Any]:
    """The plan with the directory's free bytes; NotEnoughDiskSpace (with the figures) when the
    traces would leave less than `reserve` bytes free there."""
    free = free_bytes(directory)
    if plan["bytes"] > free - reserve:
        raise NotEnoughDiskSpace(
            f"refused before collecting: the traces need up to {describe(plan)}, but "
            f"{Path(directory)} has {free / 2 ** 30:.3f} GiB free (shutil.disk_usage; "
            f"{reserve / 2 ** 30:.3f} GiB kept free); collect fewer prompts or tokens, store "
            "a projection (PROJECTION_DIM) or bfloat16 hidden states, or free disk space")
    return {**plan, "free_bytes": int(free), "directory": str(directory)}
