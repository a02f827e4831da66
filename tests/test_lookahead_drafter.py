"""LookaheadHeads.drafter: the batched drafting a TreeProposer runs reads the heads' weights as
they are when the proposer is built, so heads trained further draft with their new weights."""
import torch

from rltlab.draft_heads.lookahead import LookaheadHeads
from rltlab.engine import TreeProposer
from rltlab.model.architecture import OuroForCausalLM
from rltlab.model.config import OuroConfig

VOCAB = 64


def _heads():
    torch.manual_seed(5)
    cfg = OuroConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=8, total_ut_steps=2)
    heads = LookaheadHeads(OuroForCausalLM(cfg).eval(), depth=3, inner=24)
    for p in heads.parameters():
        torch.nn.init.normal_(p, mean=0.5 if p.dim() == 1 else 0.0, std=0.3)
    return heads


def test_proposers_draft_with_the_weights_at_their_construction():
    """fp32, random weights; a training step in between (in place, as an optimizer's)."""
    heads = _heads()
    h, nxt = torch.randn(5, 32), torch.randint(0, VOCAB, (5,))
    chain = [(0,), (0, 0), (0, 0, 0)]
    before = TreeProposer(heads, chain)
    old = heads(h, nxt).detach()
    torch.testing.assert_close(heads.draft(h, nxt), old, rtol=1e-5, atol=1e-5)
    loss = heads(torch.randn(8, 32), torch.randint(0, VOCAB, (8,))).logsumexp(-1).mean()
    loss.backward()
    with torch.no_grad():
        for p in heads.parameters():
            p -= 0.5 * p.grad
    new = heads(h, nxt).detach()
    assert (new - old).abs().max() > 1e-2          # the step changed the heads' logits
    after = TreeProposer(heads, chain)
    torch.testing.assert_close(after.draft(h, nxt), new, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(heads.draft(h, nxt), new, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(before.draft(h, nxt), old, rtol=1e-5, atol=1e-5)
