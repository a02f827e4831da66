"""Per-round statistics of one token's trace, shared by the collector and by direct recomputes.

For a token that ran rounds 1..E (E = R in teacher mode), with round-r logits z_r:

    p_r = softmax(z_r) (fp32)     top1_id / top1_prob = argmax / max of p_r
    margin_r  = p_r[top1] - p_r[top2]              (probability units)
    entropy_r = -sum p_r log p_r                   (nats)
    ref round = E, ref token = argmax p_E (the round-R token in teacher mode)
    logprob_ref_r = log p_r(ref token)             (nats; -CE_r of the round-R token)
    kl_ref_r      = KL(p_E || p_r)                 (nats; 0 at r = E)
    hazard_r = sigmoid(g_r); cdf_r = 1 - prod_{j<=r} (1 - hazard_j)   (rltlab.model.gates)
"""
from __future__ import annotations

import torch

from rltlab.model import gates

STAT_FIELDS = ("top1_id", "top1_prob", "margin", "entropy", "logprob_ref", "kl_ref")


def round_stats(logits: torch.Tensor, gate_logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """logits [E, V], gate_logits [E] for rounds 1..E of one token -> dict of [E] tensors
    (STAT_FIELDS + gate_logit, hazard, cdf) and the scalar ref_token."""
    logp = torch.log_softmax(logits.double() if logits.dtype == torch.float64 else
                             logits.float(), dim=-1)
    return stats_from_logprobs(logp, gate_logits)


def stats_from_logprobs(logp: torch.Tensor, gate_logits: torch.Tensor
                        ) -> dict[str, torch.Tensor]:
    """Same as round_stats from log-softmax rows [E, V] (already normalized)."""
    out = stats_from_logprobs_batch(logp[None], gate_logits[None])
    return {k: v[0] for k, v in out.items()}


def stats_from_logprobs_batch(logp: torch.Tensor, gate_logits: torch.Tensor
                              ) -> dict[str, torch.Tensor]:
    """stats_from_logprobs for m tokens at once, on their device: logp [m, E, V], gate_logits
    [m, E] -> [m, E] tensors and ref_token [m] (int64). The collector computes them where the
    logits are (the GPU) and copies only these small tensors to the host."""
    probs = logp.exp()
    top2 = probs.topk(min(2, probs.shape[-1]), dim=-1)
    top1_prob, top1_id = top2.values[..., 0], top2.indices[..., 0]
    second = top2.values[..., 1] if probs.shape[-1] > 1 else torch.zeros_like(top1_prob)
    entropy = -(probs * logp).sum(-1)
    ref = logp[:, -1]                                        # [m, V]: the last round's
    ref_token = ref.argmax(-1)                               # [m]
    kl = (ref.exp()[:, None, :] * (ref[:, None, :] - logp)).sum(-1).clamp_min(0.0)
    logprob_ref = logp.gather(-1, ref_token[:, None, None].expand(-1, logp.shape[1], 1))[..., 0]
    g = gates.at_least_fp32(gate_logits)
    return {"top1_id": top1_id, "top1_prob": top1_prob.float(),
            "margin": (top1_prob - second).float(), "entropy": entropy.float(),
            "logprob_ref": logprob_ref.float(), "kl_ref": kl.float(),
            "gate_logit": g.float(), "hazard": gates.hazards(g).float(),
            "cdf": gates.exit_cdf(g).float(), "ref_token": ref_token}


# fp32 logits [tokens, R, V] computed at once by stats_of_hidden (the softmax's temporaries are
# of that size too): ~340 tokens a chunk at the Ouro-1.4B shape.
STATS_CHUNK_BYTES = 2 ** 28


def stats_of_hidden(hidden: torch.Tensor, gate_logits: torch.Tensor, lm_head, vocab_size: int,
                    chunk_bytes: int = STATS_CHUNK_BYTES) -> dict[str, torch.Tensor]:
    """stats_from_logprobs_batch of h_r [m, R, H] (after the final norm) and gate logits
    [m, R], with logits = lm_head(h_r) [.., vocab_size] computed for at most chunk_bytes of
    fp32 logits at a time, on hidden's device: a whole batch's [m, R, vocab] block does not fit
    beside an engine's KV pool at the 1.4B shape."""
    m, rounds = hidden.shape[:2]
    step = max(1, chunk_bytes // (rounds * vocab_size * 4))
    parts = [stats_from_logprobs_batch(
        torch.log_softmax(lm_head(hidden[lo: lo + step]).float(), dim=-1),
        gate_logits[lo: lo + step]) for lo in range(0, m, step)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]} if parts else {}
