"""The data of self-distillation: prompts (training splits, optionally a corpus of your own
files), the target's own full-depth continuations, and their teacher features (h_d, h_R).
Used by rltlab.draft_heads.selfdistill (the module docstring there describes the recipe)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

KIND_NAMES = ("arithmetic", "text", "corpus")


@dataclass
class SequenceFeatures:
    """Teacher features of S sequences padded to T tokens: hidden[d] = h_d [S, T, H],
    final = h_R [S, T, H], mask [S, T] (real tokens), kind [S] (index into KIND_NAMES),
    split [S] (0 train, 1 held out; by prompt)."""
    hidden: dict[int, torch.Tensor]
    final: torch.Tensor
    mask: torch.Tensor
    kind: torch.Tensor
    split: torch.Tensor

    def select(self, idx: torch.Tensor) -> "SequenceFeatures":
        return SequenceFeatures({d: h[idx] for d, h in self.hidden.items()}, self.final[idx],
                                self.mask[idx], self.kind[idx], self.split[idx])

    def to_dict(self) -> dict:
        return {"hidden": self.hidden, "final": self.final, "mask": self.mask,
                "kind": self.kind, "split": self.split}


def training_prompts(tokenizer, n_arith: int, n_text: int, text_prompt_tokens: int = 24,
                     seed: int = 0, corpus: list[list[int]] = ()) -> list[tuple[list[int], int]]:
    """(prompt ids, kind) from the TRAINING splits: n_arith arithmetic questions and n_text
    stdlib-text openings of text_prompt_tokens tokens, then the `corpus` prompts as given."""
    from rltlab.exit_predictor.data import text_prompts
    from rltlab.eval.problems import rollout_prompts
    arith = rollout_prompts(tokenizer, n_arith, seed)[0] if n_arith else []
    text = text_prompts(tokenizer, n_text, text_prompt_tokens, "train", seed) if n_text else []
    return [(p, 0) for p in arith] + [(p, 1) for p in text] + [(p, 2) for p in corpus]


def corpus_prompts(tokenizer, patterns: list[str], n: int, prompt_tokens: int = 24,
                   seed: int = 0) -> tuple[list[list[int]], dict]:
    """n openings ([EOT] + prompt_tokens tokens at seeded random offsets) from the files that
    match the glob `patterns` (recursive), read in a path-hash order up to ~12 bytes per prompt
    token (the sample spreads over the whole corpus) -> (prompts, description with a content
    digest, so a rerun can tell whether it saw the same files)."""
    import glob
    import hashlib
    import os
    import zlib
    from pathlib import Path

    from rltlab.pretrain.data import EOT_ID
    from rltlab.eval.problems import encode
    files = {Path(f) for pat in patterns for f in glob.glob(pat, recursive=True)
             if Path(f).is_file()}
    if not files:
        raise ValueError(f"corpus {patterns}: no file matches")
    root = Path(os.path.commonpath(files)) if len(files) > 1 else next(iter(files)).parent
    rel = {f: f.relative_to(root).as_posix() for f in files}   # machine-independent order
    files = sorted(files, key=lambda f: (zlib.crc32(rel[f].encode()), rel[f]))
    budget, digest, ids, used, size = max(50_000, n * prompt_tokens * 12), hashlib.sha256(), \
        [], 0, 0
    for f in files:
        if size >= budget:
            break
        raw = f.read_bytes()
        digest.update(raw)
        ids += [EOT_ID] + encode(tokenizer, raw.decode("utf-8", errors="replace"))
        used, size = used + 1, size + len(raw)
    if len(ids) <= prompt_tokens + 1:
        raise ValueError(f"corpus {patterns}: only {len(ids)} tokens, need > {prompt_tokens + 1}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - prompt_tokens, (n,), generator=gen).tolist()
    prompts = [[EOT_ID] + ids[s:s + prompt_tokens] for s in starts]
    return prompts, {"patterns": list(patterns), "files_matched": len(files), "files_read": used,
                     "bytes": size, "tokens": len(ids), "sha256": digest.hexdigest()[:16]}


@torch.no_grad()
def rollouts(model, prompts: list[tuple[list[int], int]], *, max_tokens: int = 32,
             temperatures=(0.0, 1.0), eos_token_id: int = 0, batch_size: int = 64,
             seed: int = 0, progress: bool = True) -> list[tuple[list[int], int, int]]:
    """Full-depth continuations of every prompt at every temperature -> (prompt +
    continuation ids, kind, prompt index). Batches are grouped by prompt length."""
    from tqdm.auto import tqdm

    from rltlab.model.generate import generate_plain
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i][0]))
    jobs = [(t, order[lo: lo + batch_size]) for t in temperatures
            for lo in range(0, len(order), batch_size)]
    out = []
    for n, (temp, idx) in enumerate(tqdm(jobs, desc="rollouts", disable=not progress)):
        gen = generate_plain(model, [prompts[i][0] for i in idx], max_tokens,
                             temperature=temp, eos_token_id=eos_token_id, seed=seed + n)
        out += [(prompts[i][0] + cont, prompts[i][1], i) for i, cont in zip(idx, gen.token_ids)]
    return out


@torch.no_grad()
def sequence_features(model, seqs: list[tuple[list[int], int, int]], draft_rounds=(1, 2), *,
                      heldout_every: int = 10, batch_size: int = 32, pad_id: int = 0,
                      progress: bool = True) -> SequenceFeatures:
    """Teacher-forced full-depth forward over the sequences (right-padded; causal attention, so
    padding never reaches a real token) -> h_d, h_R. Held out: prompts whose index is
    divisible by heldout_every (all their continuations)."""
    from tqdm.auto import tqdm
    width = max(len(s[0]) for s in seqs)
    device = next(model.parameters()).device
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, (s, _, _) in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), True
    hidden, final = {}, None
    for lo in tqdm(range(0, len(seqs), batch_size), desc="teacher features",
                   disable=not progress):
        out = model(ids[lo: lo + batch_size].to(device))
        if final is None:
            shape = (len(seqs), width, out.final_hidden.shape[-1])
            final = torch.zeros(shape)
            hidden = {d: torch.zeros(shape) for d in draft_rounds}
        final[lo: lo + batch_size] = out.final_hidden.float().cpu()
        for d in draft_rounds:
            hidden[d][lo: lo + batch_size] = out.hidden_states[d - 1].float().cpu()
    kind = torch.tensor([s[1] for s in seqs])
    split = torch.tensor([int(s[2] % heldout_every == 0) for s in seqs])
    return SequenceFeatures(hidden, final, mask, kind, split)
