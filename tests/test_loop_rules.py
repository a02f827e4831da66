"""The library rules the rollout -> update -> evaluate notebook relies on, tested without
running it: the paired Pareto-curve comparison, Stage II gate training with early stopping, and
the loop's Stage II targets against the pretraining recipe's loss."""
import pytest
import torch


def test_compare_curves_rule():
    """The paired Pareto-curve rule: equal curves pass, a clear drop at equal rounds fails, a
    drop within 2 paired SE passes, a better curve passes; interpolation is linear."""
    from rltlab.eval.curves import compare_curves, curve_scores_at, pareto_curve

    n = 100
    base = [(1.0, [1.0] * 80 + [0.0] * 20), (2.0, [1.0] * n), (4.0, [1.0] * n)]
    same = compare_curves(base, base)
    assert same["no_worse"] is True and all(p["diff_pp"] == 0 for p in same["points"])
    worse = [(1.0, [1.0] * 60 + [0.0] * 40), (2.0, [1.0] * n), (4.0, [1.0] * n)]
    res = compare_curves(base, worse)
    assert res["no_worse"] is False
    bad = [p for p in res["points"] if p["worse"]]
    assert bad and bad[0]["mean_rounds"] == 1.0 and bad[0]["diff_pp"] == pytest.approx(-20.0)
    assert bad[0]["se_pp"] == pytest.approx(100 * (0.16 / 99) ** 0.5,
                                            rel=0.05)
    slight = [(1.0, [1.0] * 79 + [0.0] * 21), (2.0, [1.0] * n), (4.0, [1.0] * n)]
    assert compare_curves(base, slight)["no_worse"] is True     # -1 pp, se 1 pp
    better = [(1.2, [1.0] * 90 + [0.0] * 10), (1.5, [1.0] * n), (3.0, [1.0] * 99 + [0.0])]
    res = compare_curves(base, better)
    assert res["no_worse"] is True and res["overlap"] == [1.2, 3.0]
    x, s, xmax = pareto_curve(base)
    assert list(x) == [1.0, 2.0] and xmax == 4.0          # (4.0, 100%) is dominated
    assert curve_scores_at(x, s, 1.5).mean() == pytest.approx(0.9)
    assert curve_scores_at(x, s, 3.0).mean() == 1.0        # flat right of the last front point


def test_train_gate_early_stopping():
    from rltlab.loop import train_gate
    gen = torch.Generator().manual_seed(0)
    gate = torch.nn.Linear(8, 1)
    h = torch.randn(64, 4, 8, generator=gen)
    ce = torch.rand(64, 4, generator=gen) * torch.tensor([2.0, 1.0, 0.9, 0.9])
    val = (h[:16], ce[:16], None)
    res = train_gate(gate, h[16:], ce[16:], steps=60, lr=0.05, batch=16, val=val,
                     eval_every=5, patience=3)
    best = min(v for _, v in res["val_curve"])
    assert res["val_after"] == pytest.approx(best)
    assert res["best_step"] == next(s for s, v in res["val_curve"] if v == best)
    assert res["steps_run"] <= 60 and res["val_before"] is not None
    none = train_gate(gate, h[16:], ce[16:], steps=0, val=val)
    assert none["val_after"] == none["val_before"]        # nothing trained: not an improvement


def test_stage2_targets_match_pretrain_stage2_loss():
    """The loop's Stage II on traces = rltlab.pretrain.recipe.stage2_loss on the same full-depth
    hidden states (same labels, same BCE)."""
    pretrain = pytest.importorskip("rltlab.pretrain.recipe")
    import torch.nn.functional as F
    from rltlab.model.config import OuroConfig
    from rltlab.loop import stage2_targets
    from rltlab.model.architecture import OuroForCausalLM

    cfg = OuroConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=2, total_ut_steps=4)
    model = OuroForCausalLM(cfg).init_weights(1, std=0.3)
    ids = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(0))
    ref, _, _ = pretrain.stage2_loss(model, ids, 50.0, 0.005)
    with torch.no_grad():
        out = model(ids, all_logits=True)
        ce = torch.stack([F.cross_entropy(lg[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
                          for lg in out.logits], -1)
        logits = out.gate_logits[:, :-1]
    ours = F.binary_cross_entropy_with_logits(logits, 1 - stage2_targets(ce, 50.0, 0.005))
    torch.testing.assert_close(ours, ref.detach(), atol=1e-5, rtol=1e-5)
