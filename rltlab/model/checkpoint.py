"""Load and save Ouro checkpoints in the Hugging Face layout (config.json + safetensors).

Checkpoints come from outside, so loading is defensive: every tensor header is checked against
the tensors the config implies before any module is built or anything is allocated
(rltlab.model.checkpoint_checks), every tensor is checked for NaN/Inf before it goes in, pickle
files are refused, and no half-loaded model is returned.
Saving is atomic (temporary sibling directory renamed into place): a crash never mixes versions.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import tempfile
import uuid
import weakref
from pathlib import Path

import safetensors.torch
import torch
from safetensors import safe_open

from rltlab.model.config import OuroConfig
from rltlab.model.architecture import OuroForCausalLM
from rltlab.common.atomic import default_permissions
from rltlab.common.json_fields import read_json_object
from rltlab.model.checkpoint_checks import (INDEX_FILE, ExpectedTensors, check_tokenizer_files,
                                            validate_headers)

SINGLE_FILE = "model.safetensors"
_SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_STORED_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def from_pretrained(path_or_id: str | os.PathLike, dtype: torch.dtype | str | None = None,
                    device: torch.device | str = "cpu") -> OuroForCausalLM:
    """Load a validated OuroForCausalLM from a local directory or a hub id ("org/name").
    dtype: torch dtype, "float32"/"bfloat16"/"float16", or None/"auto" (config torch_dtype, else
    the stored dtype)."""
    root = _resolve_dir(path_or_id)
    config = OuroConfig.from_json_file(root / "config.json")  # FileNotFoundError names it
    files, weight_map = _weight_files(root)
    headers = validate_headers(root, files, weight_map, config)  # before building anything
    with torch.device("meta"):
        model = OuroForCausalLM(config)
    expected = ExpectedTensors(config)   # a cheap guard that the two descriptions agree
    if manifest(model) != {name: list(expected.shape(name)) for name in expected.names()}:
        raise RuntimeError("internal: checkpoint_checks.ExpectedTensors disagrees with "
                           "OuroForCausalLM's state_dict")
    stored = {_STORED_DTYPES[d] for _, d in headers.values()}  # if several, float32 holds all
    target = (_parse_dtype(dtype)
              or _parse_dtype(config.extra.get("torch_dtype") or config.extra.get("dtype"))
              or (stored.pop() if len(stored) == 1 else torch.float32))
    check_fits(sum(math.prod(expected.shape(name)) for name in expected.names())
               * target.itemsize, torch.device(device), root)
    # to_empty leaves tensors uninitialised: fine, as every state-dict entry is copied in below.
    model = model.to(target).to_empty(device=device)
    state = model.state_dict()  # detached views sharing the parameters' storage
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                if name not in headers:
                    continue   # a rotary inv_freq buffer (validate_headers warned)
                source = handle.get_tensor(name)
                tensor = source.to(device=device, dtype=target)
                if not bool(torch.isfinite(tensor).all()):
                    why = ("holds NaN/Inf values" if not bool(torch.isfinite(source).all()) else
                           f"overflows to Inf when cast {source.dtype} -> {target}")
                    raise ValueError(f"tensor {name} in {file} {why}; refusing to load")
                state[name].copy_(tensor)
    return model.eval()  # like transformers' from_pretrained


def check_fits(nbytes: int, device: torch.device, root, free_bytes: int | None = None) -> None:
    """Refuse, before anything is allocated, weights of `nbytes` that a CUDA device's free
    memory (free_bytes: that figure, else read from the device) cannot hold."""
    if device.type != "cuda":
        return
    if free_bytes is None:
        free_bytes, _ = torch.cuda.mem_get_info(device)
    if nbytes > free_bytes:
        raise ValueError(f"{root}: the weights need {nbytes / 2 ** 30:.2f} GiB on {device}, which "
                         f"has {free_bytes / 2 ** 30:.2f} GiB free; free memory, use another GPU "
                         "or load in a smaller dtype")


def load_tokenizer(path_or_id: str | os.PathLike):
    """The checkpoint's tokenizer (tokenizer.json plus tokenizer_config.json when present)."""
    from transformers import PreTrainedTokenizerFast  # heavy import, only when asked for

    root = _resolve_dir(path_or_id)
    if not (root / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{root} has no tokenizer.json")
    check_tokenizer_files(root)
    return PreTrainedTokenizerFast.from_pretrained(str(root))


def load_model_and_tokenizer(path: str | os.PathLike, dtype: torch.dtype | str | None = None,
                             device: torch.device | str = "cpu"):
    root = _resolve_dir(path)  # resolve a hub id once; a missing tokenizer fails before the load
    tokenizer = load_tokenizer(root)
    return from_pretrained(root, dtype=dtype, device=device), tokenizer


def _resolve_dir(path_or_id: str | os.PathLike) -> Path:
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise NotADirectoryError(f"{path} is a file; pass the checkpoint directory")
    missing = f"no such directory: checkpoint directory {path} does not exist"
    if not isinstance(path_or_id, str) or not _HUB_ID.match(path_or_id) \
            or _looks_like_path(path_or_id):
        raise FileNotFoundError(f"{missing} (from {Path.cwd()})")
    from huggingface_hub import snapshot_download

    offline = _hub_offline()
    try:
        return Path(snapshot_download(path_or_id, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as err:
        if offline:   # only the local cache was asked
            raise FileNotFoundError(f"{missing} (from {Path.cwd()}), and as a hub id it is not "
                                    f"in the local cache (HF_HUB_OFFLINE is set): {err}") from err
        raise FileNotFoundError(f"{path_or_id!r} is not a local directory and the hub "
                                f"could not be reached: {err}") from err


def _looks_like_path(text: str) -> bool:
    """"org/name" (the only form _HUB_ID lets through) is a hub id unless its first part exists
    here: then it is a relative path whose last part is missing."""
    return Path(text.split("/", 1)[0]).exists()


def _hub_offline() -> bool:
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
    return flag in {"1", "ON", "YES", "TRUE"} or bool(getattr(constants, "HF_HUB_OFFLINE", False))


def _weight_files(root: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files to read and, for a sharded checkpoint, the index weight_map."""
    single, index = root / SINGLE_FILE, root / INDEX_FILE
    if single.is_file() and index.is_file():
        raise ValueError(f"{root} holds both {SINGLE_FILE} and {INDEX_FILE}; remove the stale one")
    if single.is_file():
        return [single], None
    if not index.is_file():
        pickles = sorted(p.name for p in root.iterdir() if p.name.endswith(_PICKLE_SUFFIXES))
        if pickles:
            raise ValueError(  # unpickling can execute arbitrary code
                f"{root} holds only pickle checkpoints ({_names(pickles)}): refused for safety. "
                "Convert once, in a trusted environment: sd = torch.load(path, weights_only=True); "
                "safetensors.torch.save_file({k: v.contiguous().clone() for k, v in sd.items()}, "
                f"'{SINGLE_FILE}', metadata={{'format': 'pt'}})")
        raise FileNotFoundError(f"{root} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index} has no weight_map of tensor name -> shard file")
    shard_names = sorted(set(weight_map.values()))
    bad = [s for s in shard_names if not _SHARD_NAME.match(s)]  # also blocks "../" paths
    if bad:
        raise ValueError(f"{index} names shards outside the model-XXXXX-of-YYYYY pattern: {bad}")
    missing = [s for s in shard_names if not (root / s).is_file()]
    if missing:
        raise FileNotFoundError(f"{index} lists shards that do not exist: {missing}")
    return [root / s for s in shard_names], weight_map


def _names(names: list[str], limit: int = 5) -> str:
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _parse_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    if value is None or value == "auto":
        return None
    dtype = _DTYPES.get(str(value).removeprefix("torch."))  # also accepts torch.dtype
    if dtype is None:
        raise ValueError(f"unsupported dtype {value!r}; use one of {sorted(_DTYPES)} or 'auto'")
    return dtype


def save_pretrained(model: OuroForCausalLM, out_dir: str | os.PathLike, tokenizer=None,
                    max_shard_bytes: int | None = None,
                    dtype: torch.dtype | str | None = None) -> Path:
    """Atomically write config.json, weights (sharded above max_shard_bytes) and tokenizer.
    An existing out_dir is replaced as a whole: files in it that are not rewritten are gone."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"{out_dir} exists and is not a directory")
    state = _materialized_state(model)
    dtypes = {t.dtype for t in state.values()}
    target = _parse_dtype(dtype) or (dtypes.pop() if len(dtypes) == 1 else None)
    if target is None:
        raise ValueError(f"model mixes dtypes {sorted(map(str, dtypes))}; pass dtype=")
    shards = _plan_shards(state, target, max_shard_bytes)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        config = model.config.to_dict()
        config["torch_dtype"] = str(target).removeprefix("torch.")
        config.pop("dtype", None)  # transformers-5 spelling; a stale copy would contradict it
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        names = [SINGLE_FILE] if len(shards) == 1 else [
            f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
        for file_name, shard in zip(names, shards):
            # Fresh contiguous CPU copies, one shard at a time: safetensors refuses shared
            # storage, and cloning everything at once would double peak memory.
            tensors = {n: state[n].detach().to("cpu", target).clone(
                memory_format=torch.contiguous_format) for n in shard}
            safetensors.torch.save_file(tensors, tmp / file_name, metadata={"format": "pt"})
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(
                         t.numel() * target.itemsize for t in state.values())},
                     "weight_map": {n: f for f, shard in zip(names, shards) for n in shard}}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        _fsync_tree(tmp)
        default_permissions(tmp)
        _swap_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _plan_shards(state: dict[str, torch.Tensor], dtype: torch.dtype,
                 max_shard_bytes: int | None) -> list[list[str]]:
    """Greedy, in state-dict order; a tensor larger than the limit gets a shard of its own."""
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * dtype.itemsize
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _fsync_tree(directory: Path) -> None:
    """Flush file contents before the rename, or a power loss could publish empty files."""
    for path in [*directory.iterdir(), directory]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _swap_into_place(tmp: Path, out_dir: Path) -> None:
    if not out_dir.exists():
        os.rename(tmp, out_dir)
        return
    # A directory cannot be atomically replaced by another: move the old one aside first and
    # put it back if the second rename fails.
    old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except BaseException:
        os.rename(old, out_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)


def manifest(model: torch.nn.Module) -> dict[str, list[int]]:
    """Tensor name -> shape of every checkpoint tensor (works on a meta-device model)."""
    return {name: list(t.shape) for name, t in model.state_dict().items()}


def num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def model_hash(model: torch.nn.Module) -> str:
    """sha256 (16 hex chars) of sorted names, shapes, dtypes and raw bytes; add-ons record it
    to detect being loaded onto another base model (or the same one in another dtype).

    The digest is kept per model beside a fingerprint of its weights (_fingerprint: a sum of
    every tensor's raw 64-bit words, computed where the tensor lives) and reused while the
    fingerprint is unchanged: at the Ouro-1.4B shape the sha256 reads ~3 GB through the host
    (seconds), the fingerprint ~3 GB on the GPU (about a millisecond), and every trace
    collector hashes the engine's model when it opens."""
    state = _materialized_state(model)
    names = sorted(state)
    key = _fingerprint(state, names)
    cached = _HASHES.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]
    digest = hashlib.sha256()
    for name in names:
        tensor = state[name].detach()
        digest.update(f"{name}\0{list(tensor.shape)}\0{tensor.dtype}\0".encode())
        # Size follows from shape and dtype, so the byte stream needs no length prefix.
        digest.update(tensor.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
    _HASHES[model] = (key, digest.hexdigest()[:16])
    return _HASHES[model][1]


_HASHES: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, str]]" = \
    weakref.WeakKeyDictionary()


def _fingerprint(state: dict[str, torch.Tensor], names: list[str]) -> tuple:
    """Names, shapes, dtypes, devices and a sum of each tensor's raw bytes as 64-bit words
    (bytes where the size is not a multiple of 8), summed on the tensor's own device and read
    back once per device: any change to one word of any tensor changes it, whether made
    through an optimizer, copy_, update_weights or .data (which bypasses torch's version
    counters)."""
    layout, sums = [], {}
    for name in names:
        tensor = state[name].detach()
        layout.append((name, tuple(tensor.shape), str(tensor.dtype), str(tensor.device)))
        words = tensor.contiguous().reshape(-1).view(torch.uint8)
        # 8-byte words summed as int64 (wrapping) where the size allows: no conversion pass,
        # so it runs at memory speed on the CPU too; bytes otherwise
        words = words.view(torch.int64) if words.numel() % 8 == 0 else words.to(torch.int64)
        sums.setdefault(tensor.device, []).append(words.sum())
    # one read-back per device
    return tuple(layout), tuple((str(device), tuple(torch.stack(parts).tolist()))
                                for device, parts in sums.items())


def _materialized_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    meta = [name for name, t in state.items() if t.is_meta]
    if meta:
        raise ValueError(f"model has meta (unallocated) tensors: {_names(meta)}")
    return state


def load_model(model_dir: str | os.PathLike | None = None, dtype: str | None = "auto",
               device: str | None = "auto", threads: int | None = None,
               hf_tokenizer: bool = False):
    """(model, tokenizer, model_dir): model_dir None = the embedded default (artifacts/ouro-tiny).
    device "auto": CUDA where there is one, else the CPU (a device this machine lacks is a
    ValueError in one line); dtype "auto": bfloat16 on a GPU, float32 on the CPU.

    The tokenizer is a `tokenizers.Tokenizer` read from tokenizer.json (no transformers
    import: notebooks start faster); hf_tokenizer=True gives the transformers fast tokenizer.
    Both work with rltlab.eval.tasks (ids without special tokens).
    """
    from rltlab.common.device import AUTO, default_dtype, resolve_device
    from rltlab.common.paths import embedded_model_dir

    device = resolve_device(device)
    if dtype is None or dtype == AUTO:
        dtype = default_dtype(device)
    if threads:
        torch.set_num_threads(threads)
    # a Path, so a missing directory is named as one and never looked up on the hub
    path = _resolve_dir(Path(model_dir)) if model_dir else embedded_model_dir()
    if hf_tokenizer:
        tokenizer = load_tokenizer(path)
    else:
        from tokenizers import Tokenizer
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json")
        check_tokenizer_files(path)
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    return from_pretrained(path, dtype=dtype, device=device), tokenizer, path
