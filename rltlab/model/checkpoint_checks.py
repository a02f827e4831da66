"""Checks that rltlab.model.checkpoint runs on a checkpoint before it builds or allocates anything.

* The tensors a config implies are described analytically (`ExpectedTensors`), without building
  the model: a config.json with num_hidden_layers=10**7 is refused in milliseconds, not after
  building ten million meta layers.
* Rotary `inv_freq` buffers, which some exporters save, are skipped with a warning (rltlab
  computes RoPE from rope_theta); any other unknown tensor stays an error.
* tokenizer.json / tokenizer_config.json are parsed first, so a truncated or odd file raises
  an error that names the file and the field instead of a bare JSONDecodeError or TypeError.
"""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Iterator

from safetensors import SafetensorError, safe_open

from rltlab.common.json_fields import read_json_object
from rltlab.model.config import OuroConfig

INDEX_FILE = "model.safetensors.index.json"
STORED_DTYPES = ("BF16", "F16", "F32")
# Exporters of HF-style rotary embeddings save inv_freq = 1 / theta^(2i/d) as a buffer, per layer
# (older transformers) or once for the model; its values follow from rope_theta.
ROTARY_BUFFER = re.compile(r"^model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq$")
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class ExpectedTensors:
    """name -> shape of every checkpoint tensor of the OuroForCausalLM a config describes (the
    same names and shapes as its state_dict, which tests/test_faults_checkpoint.py checks)."""

    def __init__(self, config: OuroConfig):
        h, v, i = config.hidden_size, config.vocab_size, config.intermediate_size
        q, kv = config.num_attention_heads * config.head_dim, \
            config.num_key_value_heads * config.head_dim
        self.num_layers = config.num_hidden_layers
        self.top = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
                    "model.early_exit_gate.weight": (1, h), "model.early_exit_gate.bias": (1,),
                    "lm_head.weight": (v, h)}
        self.per_layer = {
            "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
            "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
            "mlp.down_proj.weight": (h, i), "input_layernorm.weight": (h,),
            "input_layernorm_2.weight": (h,), "post_attention_layernorm.weight": (h,),
            "post_attention_layernorm_2.weight": (h,)}

    def __len__(self) -> int:
        return len(self.top) + self.num_layers * len(self.per_layer)

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The expected shape, or None for a name the model does not have."""
        if name in self.top:
            return self.top[name]
        match = _LAYER_NAME.match(name)
        if match is None or str(int(match.group(1))) != match.group(1) \
                or int(match.group(1)) >= self.num_layers:   # "layers.01" is not layer 1
            return None
        return self.per_layer.get(match.group(2))

    def names(self) -> Iterator[str]:
        """Every expected name, lazily (a huge num_hidden_layers costs nothing until read)."""
        yield from self.top
        for layer in range(self.num_layers):
            for suffix in self.per_layer:
                yield f"model.layers.{layer}.{suffix}"

    def missing(self, found: set[str], limit: int = 5) -> tuple[int, list[str]]:
        """(how many expected names are not in `found`, the first `limit` of them). Reads at
        most len(found) + limit names, so it stays fast for any num_hidden_layers."""
        present = sum(1 for name in found if self.shape(name) is not None)
        first = []
        for name in self.names():
            if len(first) == limit or len(first) == len(self) - present:
                break
            if name not in found:
                first.append(name)
        return len(self) - present, first


def validate_headers(root: Path, files: list[Path], weight_map: dict[str, str] | None,
                     config: OuroConfig) -> dict[str, tuple[Path, str]]:
    """Check names, shapes and dtypes from the headers alone against `config`; returns
    name -> (file, stored dtype) of the tensors to load (rotary buffers left out, with a
    warning). Raises ValueError listing every problem."""
    expected = ExpectedTensors(config)
    found: dict[str, tuple[Path, str]] = {}
    rotary, stored_params = [], 0
    duplicated, misplaced, wrong_shape, bad_dtype, unexpected = [], [], [], [], []
    for file in files:
        try:
            with safe_open(file, framework="pt") as handle:
                for name in handle.keys():
                    header = handle.get_slice(name)
                    shape, stored_dtype = tuple(header.get_shape()), header.get_dtype()
                    if name in found or name in rotary:
                        first = found[name][0].name if name in found else "another shard"
                        duplicated.append(f"{name} ({first}, {file.name})")
                        continue
                    if weight_map is not None and weight_map.get(name) != file.name:
                        misplaced.append(f"{name} (index: {weight_map.get(name)}, "
                                         f"actual: {file.name})")
                    if ROTARY_BUFFER.match(name):
                        rotary.append(name)
                        continue
                    found[name] = (file, stored_dtype)
                    want = expected.shape(name)
                    if want is None:
                        unexpected.append(name)
                        continue
                    stored_params += _numel(shape)
                    if shape != want:
                        wrong_shape.append(f"{name} {list(shape)} != {list(want)}")
                    if stored_dtype not in STORED_DTYPES:
                        bad_dtype.append(f"{name} ({stored_dtype})")
        except SafetensorError as err:
            raise ValueError(f"{file} is not a valid safetensors file: {err}") from err
    num_missing, first_missing = expected.missing(set(found))
    listed = sorted(set(weight_map or ()) - set(found) - set(rotary))
    problems = [
        ("duplicated across shards", duplicated, len(duplicated)),
        (f"not where {INDEX_FILE} says", misplaced, len(misplaced)),
        (f"listed in {INDEX_FILE} but in no shard", listed, len(listed)),
        ("missing", first_missing, num_missing),
        ("unexpected", sorted(unexpected), len(unexpected)),
        ("with the wrong shape", wrong_shape, len(wrong_shape)),
        (f"with an unsupported dtype (need one of {sorted(STORED_DTYPES)})", bad_dtype,
         len(bad_dtype))]
    lines = [f"  - {count} tensor(s) {label}: {_names(names, count)}"
             for label, names, count in problems if count]
    if num_missing:
        lines.append(f"  - config.json implies {len(expected):,} tensors "
                     f"({config.num_hidden_layers:,} layers, "
                     f"{config.num_parameters():,} parameters); the files hold "
                     f"{len(found):,} tensors ({stored_params:,} parameters of known names)")
    if lines:
        raise ValueError(f"checkpoint {root} does not match the OuroForCausalLM of its "
                         "config.json:\n" + "\n".join(lines))
    if rotary:
        warnings.warn(f"checkpoint {root}: skipping {len(rotary)} rotary inv_freq buffer(s) "
                      f"({_names(rotary, len(rotary))}); rltlab computes RoPE from "
                      f"rope_theta={config.rope_theta}", stacklevel=3)
    return found


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _names(names: list[str], count: int, limit: int = 5) -> str:
    shown = names[:limit]
    more = f", ... ({count - len(shown)} more)" if count > len(shown) else ""
    return ", ".join(shown) + more


# ------------------------------------------------------------------------------- tokenizer
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                   "cls_token", "mask_token")
_BOOL_KEYS = ("add_bos_token", "add_eos_token", "clean_up_tokenization_spaces",
              "add_prefix_space", "legacy")


def check_tokenizer_files(root: Path) -> None:
    """Parse tokenizer.json (and tokenizer_config.json when present) before a tokenizer
    library reads them; raise ValueError naming the file and the field."""
    from tokenizers import Tokenizer

    path = root / "tokenizer.json"
    data = read_json_object(path)
    for key, kind in (("model", dict), ("added_tokens", list)):   # transformers needs both
        if not isinstance(data.get(key), kind):
            raise ValueError(f"{path}: field {key!r} must be a JSON "
                             f"{'object' if kind is dict else 'array'}, got "
                             f"{data.get(key)!r:.80}")
    try:
        Tokenizer.from_str(json.dumps(data))
    except Exception as err:   # tokenizers raises a bare Exception naming the field
        raise ValueError(f"{path} is not a valid tokenizers file: {err}") from err
    config_path = root / "tokenizer_config.json"
    if not config_path.is_file():
        return
    config = read_json_object(config_path)
    for key in _SPECIAL_TOKENS:
        value = config.get(key)
        if value is not None and not isinstance(value, str) and not (
                isinstance(value, dict) and isinstance(value.get("content"), str)):
            raise ValueError(f"{config_path}: field {key!r} must be a string or an AddedToken "
                             f"object with a 'content' string, got {value!r:.80}")
    for key in _BOOL_KEYS:
        if key in config and not isinstance(config[key], bool):
            raise ValueError(f"{config_path}: field {key!r} must be true or false, got "
                             f"{config[key]!r:.80}")
    length = config.get("model_max_length")
    if length is not None and (isinstance(length, bool) or not isinstance(length, (int, float))
                               or not length > 0):
        raise ValueError(f"{config_path}: field 'model_max_length' must be a positive number, "
                         f"got {length!r:.80}")
    for key, kind in (("tokenizer_class", str), ("added_tokens_decoder", dict)):
        if config.get(key) is not None and not isinstance(config[key], kind):
            raise ValueError(f"{config_path}: field {key!r} must be a {kind.__name__}, got "
                             f"{config[key]!r:.80}")
