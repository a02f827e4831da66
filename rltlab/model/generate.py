"""The model's plain cached generation loop: the simple baseline the engine is measured against.

Left-padded batch, one contiguous K/V plane per round (LoopedKVCache), prefill at full depth,
then one token per step with an exit decision after every round. Rows that finished keep
stepping (their tokens are discarded): simple, not fast.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rltlab.model import gates
from rltlab.model.architecture import LoopedKVCache, OuroForCausalLM

SAMPLING_EPS = 1e-5   # temperatures below this are greedy (vLLM's rule; the engine's sampler too)


@dataclass
class PlainGeneration:
    token_ids: list[list[int]]
    exit_rounds: list[list[int]]   # per output token; the first (from prefill) is always R
    logprobs: list[list[float]]    # raw log-prob of each output token at its exit round


def make_exit_fn(num_rounds: int, depth: int | None = None, threshold: float = 1.0,
                 min_loops: int = 1, max_loops: int | None = None):
    """Fixed depth (`depth`) or the stock Q-exit (threshold/min_loops/max_loops)."""
    if depth is not None:
        min_loops, max_loops, threshold = depth, depth, 1.0
    max_loops = num_rounds if max_loops is None else max_loops
    gates.validate_loops(num_rounds, min_loops, max_loops, threshold)

    def exit_fn(round_idx, gate_logits, _hidden):
        cdf = gates.exit_cdf(gate_logits)[..., -1]
        return gates.q_exit_now(cdf, round_idx, threshold, min_loops, max_loops)
    return exit_fn


def left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, ...]:
    """Left-padded ids [B, W], key mask (True = real token) and positions that count real tokens
    only, so a padded row computes exactly what it computes unpadded."""
    bsz, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((bsz, width), pad_id, dtype=torch.long, device=device)
    key_mask = torch.zeros(bsz, width, dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, device=device)
        key_mask[row, width - len(prompt):] = True
    positions = (key_mask.long().cumsum(-1) - 1).clamp(min=0)
    return ids, key_mask, positions


@torch.no_grad()
def generate_plain(model: OuroForCausalLM, prompts: list[list[int]], max_new_tokens: int, *,
                   depth: int | None = None, threshold: float = 1.0, min_loops: int = 1,
                   max_loops: int | None = None, temperature: float = 0.0,
                   eos_token_id: int | list[int] | None = None, seed: int = 0
                   ) -> PlainGeneration:
    """eos_token_id: one id or several (a list-valued config eos_token_id); a row stops at the
    first of them it emits. None: no stop."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate_plain needs at least one non-empty prompt")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    num_rounds = model.config.num_rounds
    exit_fn = make_exit_fn(num_rounds, depth, threshold, min_loops, max_loops)
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    bsz, width = len(prompts), max(len(p) for p in prompts)
    stop_ids = _stop_ids(eos_token_id)
    pad_id = next(iter(model.config.eos_token_ids), 0)   # any id: padding is masked out
    ids, key_mask, positions = left_pad(prompts, pad_id, device)
    next_pos = positions[:, -1] + 1

    cache = LoopedKVCache(model.config, bsz, width + max_new_tokens, dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = model(ids, positions=positions, key_mask=key_mask, cache=cache)
    logits, exit_round = out.final_logits[:, -1], torch.full((bsz,), num_rounds, device=device)
    tokens, rounds, logps = [], [], []
    done = torch.zeros(bsz, dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        logp = torch.log_softmax(logits.float(), dim=-1)
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            token = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
        else:
            token = logits.argmax(-1)
        tokens.append(token)
        rounds.append(exit_round)
        logps.append(logp.gather(-1, token[:, None]).squeeze(-1))
        if stop_ids:
            done = done | torch.isin(token, torch.tensor(stop_ids, device=device))
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        out = model(token[:, None], positions=(next_pos + step)[:, None], cache=cache,
                    exit_fn=exit_fn)
        logits, exit_round = out.final_logits[:, -1], out.exit_rounds[:, -1]
    return _collect(tokens, rounds, logps, stop_ids)


def _stop_ids(eos_token_id: int | list[int] | None) -> list[int]:
    ids = [] if eos_token_id is None else list(eos_token_id) \
        if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
        raise ValueError(f"eos_token_id must be an int, a list of ints or None, got "
                         f"{eos_token_id!r}")
    return ids


def _collect(tokens, rounds, logps, stop_ids: list[int]) -> PlainGeneration:
    tok = torch.stack(tokens, 1).tolist()
    rnd = torch.stack(rounds, 1).tolist()
    lp = torch.stack(logps, 1).tolist()
    result = PlainGeneration([], [], [])
    for t, r, p in zip(tok, rnd, lp):
        end = next((i + 1 for i, token in enumerate(t) if token in stop_ids), len(t))
        result.token_ids.append(t[:end])
        result.exit_rounds.append([int(x) for x in r[:end]])
        result.logprobs.append(p[:end])
    return result
