"""Lookahead heads on round R's state and the draft tree they fill (issue 16).

Head k (k = 1..depth) reads the final round's state h_R at the position that produced token
x_{t+1} and the embedding of x_{t+1}, and predicts x_{t+1+k}: Medusa-style drafting, free from
the previous verification pass. logits_k = lm_head(h + down(silu(up([norm(h), norm_e(emb)])))),
lm_head and the embedding frozen and shared with the model.

A tree is a prefix-closed set of rank paths: (r1, ..., rj) drafts head 1's r1-th token, then
head 2's r2-th, ... (0 = the head's top-1). Because a head's candidates do not depend on the
path, the true continuation is in the tree iff the rank of x_{t+1+k} under head k is r_k for
k <= j; `tree_from_ranks` keeps the most frequent such prefixes of a calibration set.

On disk (`save` / `load`): heads.safetensors + lookahead.json (depth, inner, tree, base model
hash, the weights' sha256, training record), written atomically, the metadata last. `load`
checks every field, the sha256 (heads saved before it was recorded are refused: see
`record_sha256`) and that every weight is finite; a bad file is named in the error.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_bytes
from torch import nn

from rltlab.common.atomic import write_bytes_atomic, write_json_atomic
from rltlab.common.json_files import JSONFileError, check_field, read_json_file
from rltlab.engine.spec.proposers import TreeProposer, validate_tree
from rltlab.model.architecture import OuroForCausalLM, RMSNorm

META_FILE, WEIGHTS_FILE = "lookahead.json", "heads.safetensors"


class _Head(nn.Module):
    def __init__(self, hidden: int, inner: int, eps: float):
        super().__init__()
        self.norm, self.norm_e = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.up = nn.Linear(2 * hidden, inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)
        nn.init.normal_(self.up.weight, std=hidden ** -0.5)
        nn.init.zeros_(self.down.weight)   # starts as the model's own lm_head on h

    def forward(self, h: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.silu(self.up(torch.cat([self.norm(h), self.norm_e(emb)], -1))))


class LookaheadHeads(nn.Module):
    """heads(h [N, H], next_token [N]) -> logits [N, depth, V]."""

    def __init__(self, model: OuroForCausalLM, depth: int = 4, inner: int = 1024):
        super().__init__()
        if depth < 1 or inner < 1:
            raise ValueError(f"depth and inner must be >= 1, got {depth} and {inner}")
        cfg = model.config
        self.depth, self.inner = depth, inner
        self.heads = nn.ModuleList(_Head(cfg.hidden_size, inner, cfg.rms_norm_eps)
                                   for _ in range(depth))
        self._model = [model]   # shared and frozen: not this module's parameters

    def forward(self, h: torch.Tensor, next_token: torch.Tensor) -> torch.Tensor:
        model = self._model[0]
        emb = model.model.embed_tokens(next_token).to(h.dtype)
        return torch.stack([model.lm_head(head(h, emb)) for head in self.heads], dim=-2)

    def draft(self, h: torch.Tensor, next_token: torch.Tensor) -> torch.Tensor:
        """forward's logits through drafter(): the heads' weights as they are at this call."""
        return self.drafter()(h, next_token)

    @torch.no_grad()
    def drafter(self):
        """-> draft(h, next_token), forward's logits with the heads batched: one normalisation
        of h and of the embedding, one batched matmul per projection (about 15 kernels instead
        of ~75; a decode-time draft inside a device program is launch-bound). It reads the
        heads' weights as they are now, stacked once: a TreeProposer built after more training
        drafts with the new ones, one built before keeps the old (as its captured programs
        do)."""
        heads = self.heads
        w_norm, w_norm_e, w_up, w_down = (
            torch.stack([hd.norm.weight for hd in heads]),
            torch.stack([hd.norm_e.weight for hd in heads]),
            torch.stack([hd.up.weight.t() for hd in heads]),
            torch.stack([hd.down.weight.t() for hd in heads]))
        model, eps = self._model[0], heads[0].norm.eps

        def draft(h: torch.Tensor, next_token: torch.Tensor) -> torch.Tensor:
            emb = model.model.embed_tokens(next_token).to(h.dtype)
            parts = torch.cat([_unit_rms(h, eps)[None] * w_norm[:, None],
                               _unit_rms(emb, eps)[None] * w_norm_e[:, None]], -1)  # [d, N, 2H]
            inner = F.silu(torch.bmm(parts, w_up))
            out = h[None] + torch.bmm(inner, w_down)                             # [depth, N, H]
            return model.lm_head(out).transpose(0, 1)                            # [N, depth, V]
        return draft


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without its weight, in the model's order (normalise in fp32, cast back)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def tree_from_ranks(ranks: list[torch.Tensor], budget: int, max_rank: int = 64
                    ) -> list[tuple[int, ...]]:
    """The `budget` most frequent rank prefixes. ranks: per sequence, [L, depth] rank of the
    true x_{t+1+k} under head k (-1 past the end). A prefix is never rarer than its
    extensions, so with ties broken toward shorter prefixes the result is prefix-closed."""
    counts: dict[tuple[int, ...], int] = {}
    for r in ranks:
        for row in r.tolist():
            for k, rank in enumerate(row):
                if rank < 0 or rank >= max_rank:
                    break
                key = tuple(row[:k + 1])
                counts[key] = counts.get(key, 0) + 1
    tree: set[tuple[int, ...]] = set()
    for p in sorted(counts, key=lambda p: (-counts[p], len(p), p)):
        if len(tree) == budget:
            break
        if len(p) == 1 or p[:-1] in tree:
            tree.add(p)
    return sorted(tree, key=lambda p: (len(p), p))


def save(heads: LookaheadHeads, path, tree, base_model_hash: str, training: dict,
         dtype: torch.dtype | None = None) -> None:
    """dtype: the weights' dtype on disk (None: as they are; `load` casts to the model's)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(dtype).contiguous().cpu() for k, v in heads.state_dict().items()}
    data = safetensors_bytes(tensors)
    meta = {"kind": "lookahead", "depth": heads.depth, "inner": heads.inner,
            "tree": [list(p) for p in validate_tree(tree, heads.depth)],
            "base_model_hash": base_model_hash,
            "weights_sha256": hashlib.sha256(data).hexdigest(), "training": training}
    write_bytes_atomic(path / WEIGHTS_FILE, data)
    write_json_atomic(path / META_FILE, meta, indent=1)     # last: it vouches for the weights


def record_sha256(path) -> str:
    """Record heads.safetensors' sha256 in lookahead.json (heads saved before `save` recorded
    it). Only for files known to be the ones trained: from then on `load` refuses any other."""
    path = Path(path)
    meta = read_json_file(path / META_FILE)
    meta["weights_sha256"] = hashlib.sha256((path / WEIGHTS_FILE).read_bytes()).hexdigest()
    write_json_atomic(path / META_FILE, meta, indent=1)
    return meta["weights_sha256"]


def read_metadata(path) -> dict:
    """lookahead.json, every field checked: JSONFileError (a ValueError) naming the file and
    the field."""
    meta_path = Path(path) / META_FILE
    meta = read_json_file(meta_path)
    if check_field(meta, meta_path, "kind", str, required=True) != "lookahead":
        raise JSONFileError(meta_path, f"is {meta['kind']!r}, expected 'lookahead'", "kind")
    for name in ("depth", "inner"):
        if check_field(meta, meta_path, name, int, required=True) < 1:
            raise JSONFileError(meta_path, f"must be >= 1, got {meta[name]}", name)
    check_field(meta, meta_path, "base_model_hash", str, required=True)
    if "weights_sha256" not in meta:
        raise JSONFileError(meta_path, f"missing: these heads were saved before {WEIGHTS_FILE}'s "
                            "sha256 was recorded. Save them again (lookahead.save), or, if "
                            "the files are the ones trained, record it: python -c \"from "
                            "rltlab.draft_heads.lookahead import record_sha256; "
                            f"record_sha256('{Path(path)}')\"", "weights_sha256")
    digest = check_field(meta, meta_path, "weights_sha256", str)
    if len(digest) != 64:
        raise JSONFileError(meta_path, f"is not a sha256 ({digest!r:.80})", "weights_sha256")
    check_field(meta, meta_path, "training", dict)
    tree = check_field(meta, meta_path, "tree", list, required=True)
    if not all(isinstance(p, list) and all(isinstance(r, int) and not isinstance(r, bool)
                                           for r in p) for p in tree):
        raise JSONFileError(meta_path, "must be a list of rank paths (lists of ints), got "
                            f"{tree!r:.80}", "tree")
    try:
        validate_tree(tree, meta["depth"])
    except ValueError as err:
        raise JSONFileError(meta_path, str(err), "tree") from None
    return meta


def load(path, model: OuroForCausalLM, check_hash: bool = True
         ) -> tuple[LookaheadHeads, list[tuple[int, ...]], dict]:
    """-> (heads on the model's device and dtype, tree, metadata). Refused with a ValueError
    naming the file: a bad lookahead.json field, weights whose sha256 is not the recorded one,
    an unreadable heads.safetensors or one of other tensors, a NaN / Inf weight; and, unless
    check_hash=False, heads trained for another model."""
    path = Path(path)
    if not (path / META_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"{path} holds no lookahead heads ({META_FILE} + {WEIGHTS_FILE})")
    meta = read_metadata(path)
    if check_hash:
        from rltlab.model.checkpoint import model_hash
        if meta["base_model_hash"] != model_hash(model):
            raise ValueError(f"{path} was trained for model {meta['base_model_hash']}, not "
                             f"{model_hash(model)} (check_hash=False to load anyway)")
    weights = path / WEIGHTS_FILE
    data = weights.read_bytes()
    if hashlib.sha256(data).hexdigest() != meta["weights_sha256"]:
        raise ValueError(f"{weights} does not match the sha256 recorded in {path / META_FILE}: "
                         "truncated, corrupt or replaced")
    try:
        state = safetensors_load(data)
    except Exception as err:     # safetensors' SafetensorError and friends
        raise ValueError(f"{weights} cannot be read as safetensors: {err}") from None
    heads = LookaheadHeads(model, meta["depth"], meta["inner"])
    try:
        heads.load_state_dict(state)
    except RuntimeError as err:  # missing / unexpected tensors, other shapes
        text = " ".join(str(err).split())
        raise ValueError(f"{weights} does not hold heads of depth {meta['depth']} and inner "
                         f"{meta['inner']} (as {META_FILE} says) for this model (hidden size "
                         f"{model.config.hidden_size}): {text[:400]}") from None
    bad = [n for n, t in state.items() if not bool(torch.isfinite(t).all())]
    if bad:
        raise ValueError(f"{weights}: tensor(s) {', '.join(sorted(bad)[:5])} hold NaN/Inf "
                         "values; refusing the heads")
    param = next(model.parameters())
    return (heads.to(device=param.device, dtype=param.dtype).eval(),
            validate_tree(meta["tree"], meta["depth"]), meta)


def load_proposer(path, model: OuroForCausalLM, tree=None, check_hash: bool = True,
                  lookup: int = 0, ngram: int = 3, adaptive_lookup: bool | str = False,
                  first_drafts: bool = False):
    """A rltlab.engine.TreeProposer from saved heads, with their own tree or `tree` (and a
    prompt-lookup chain of `lookup` nodes, TreeProposer's lookup / ngram / adaptive_lookup
    (False, True or "hits", "agree") / first_drafts); load it onto the model the engine runs
    (same dtype and device)."""
    heads, own_tree, _ = load(path, model, check_hash=check_hash)
    return TreeProposer(heads, own_tree if tree is None else tree, lookup=lookup, ngram=ngram,
                        adaptive_lookup=adaptive_lookup, first_drafts=first_drafts)
