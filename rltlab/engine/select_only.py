"""Select-only exit (EngineConfig.exit_semantics = "select_only"): what the public Hugging Face
Ouro code does with `exit_threshold` (docs/ouro.md, KV semantics).

Every token, prompt and decode alike, runs all R rounds and writes its own K/V into every
plane: nothing is skipped and nothing is copied, so later tokens always attend to full-depth
K/V of earlier ones. The exit rule only SELECTS the round whose state a sampling position's
output comes from, at every sampling position, the last prompt position included (so the first
output token can come from an early round). The engine keeps (h_r, g_r) of a sampling position
after each round (Span.select_states) and picks at round R:

    q_exit  the first round r with r >= max_loops, or threshold < 1 and r >= min_loops and
            CDF_r >= threshold (CDF in fp32; threshold >= 1 never fires, so it selects
            max_loops). The HF code: min_loops 1 (the select_only default), max_loops R.
    fixed   min(depth, max_loops) (the HF code's exit_at_step = depth - 1).

Other policies decide when a token stops computing, which has no meaning here: refused.
exit_depths report the selected round, executed_depths R, log-probs the selected round's.
"""
from __future__ import annotations

import torch

from rltlab.engine.exit_policies import ExitPolicy, FixedDepth, QExit
from rltlab.model import gates

SELECTABLE = (QExit, FixedDepth)


def check_policy(policy: ExitPolicy, where: str) -> None:
    """Refuse a policy select_only cannot apply (ValueError naming `where` and the policy)."""
    if type(policy) not in SELECTABLE:
        names = [cls.name for cls in SELECTABLE]
        raise ValueError(f"{where}: exit policy {policy.name!r} cannot run under "
                         "EngineConfig.exit_semantics='select_only' (every token runs all "
                         f"rounds; only the {names} rules select an output round)")


def selected_rounds(gate_logits: torch.Tensor, params: list, fixed: list[bool]) -> list[int]:
    """The output round (1-based) of each row from its gate logits g_1..g_R [N, R], its
    request's effective SamplingParams and whether its policy is `fixed` (else q_exit)."""
    num_rounds, dev = gate_logits.shape[1], gate_logits.device

    def column(values, dtype):
        return torch.tensor(values, dtype=dtype, device=dev)[:, None]

    rounds = torch.arange(1, num_rounds + 1, device=dev)[None, :]
    threshold = column([p.exit_threshold for p in params], torch.float32)
    min_loops = column([p.min_loops for p in params], torch.int64)
    max_loops = column([p.max_loops for p in params], torch.int64)
    depth = column([min(p.exit_policy_args.get("depth", p.max_loops), p.max_loops)
                    for p in params], torch.int64)
    cdf = gates.exit_cdf(gate_logits)
    q_fires = (rounds >= max_loops) | ((threshold < 1.0) & (rounds >= min_loops)
                                       & (cdf >= threshold))
    # round max_loops <= R always fires
    fires = torch.where(column(fixed, torch.bool), rounds >= depth, q_fires)
    return (fires.int().argmax(dim=-1) + 1).tolist()        # argmax: the first True


def choose_outputs(emitting: list, states: list[list], policy_of) -> list:
    """emitting: (seq, h_R, R) per sampling position; states: its (h_r, g_r) per round;
    policy_of: policy name -> ExitPolicy -> (seq, h of the selected round, that round)."""
    if not emitting:
        return emitting
    gate_logits = torch.stack([torch.stack([g for _, g in st]) for st in states]).float()
    params = [seq.params for seq, _, _ in emitting]
    fixed = [isinstance(policy_of(p.exit_policy), FixedDepth) for p in params]
    chosen = selected_rounds(gate_logits, params, fixed)
    return [(seq, st[r - 1][0], r) for (seq, _, _), st, r in zip(emitting, states, chosen)]
