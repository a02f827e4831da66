"""The reference model: gate math, gradients through shared rounds, LAST_EXITED semantics."""
import math

import pytest
import torch

from rltlab.model import gates
from rltlab.model.config import OuroConfig
from rltlab.model.architecture import LoopedKVCache, OuroForCausalLM


def tiny_config(**overrides) -> OuroConfig:
    base = dict(vocab_size=53, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, total_ut_steps=4,
                max_position_embeddings=256)
    base.update(overrides)
    return OuroConfig(**base)


def tiny_model(seed=0, dtype=torch.float64, **overrides) -> OuroForCausalLM:
    model = OuroForCausalLM(tiny_config(**overrides)).init_weights(seed, std=0.25)
    with torch.no_grad():  # non-trivial norm weights and gate, so every term is exercised
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if "norm" in name or "early_exit_gate" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.to(dtype)


# ---------------------------------------------------------------- gate math by hand

def test_gate_math_matches_hand_computation():
    g = torch.tensor([0.0, math.log(3.0), -math.log(3.0), 2.0])  # hazards 1/2, 3/4, 1/4, -
    lam = gates.hazards(g)
    assert torch.allclose(lam[:3], torch.tensor([0.5, 0.75, 0.25]))
    surv = gates.survival(g)
    assert torch.allclose(surv[:3], torch.tensor([0.5, 0.125, 0.09375]))
    assert torch.allclose(gates.exit_cdf(g)[:3], torch.tensor([0.5, 0.875, 0.90625]))
    # p(1)=1/2, p(2)=3/4*1/2, p(3)=1/4*1/8, p(4)=S_3
    expected = torch.tensor([0.5, 0.375, 0.03125, 0.09375])
    assert torch.allclose(gates.exit_distribution(g), expected)
    assert torch.allclose(gates.exit_distribution(torch.randn(7, 5, 4)).sum(-1),
                          torch.ones(7, 5))


def test_gate_math_is_fp32_even_for_bf16_input():
    g = torch.randn(10, 4).bfloat16()
    assert gates.exit_cdf(g).dtype == torch.float32
    assert gates.exit_distribution(g).dtype == torch.float32


@pytest.mark.parametrize("threshold,min_loops,max_loops,expected", [
    (0.6, 1, 4, 2),    # CDF 0.5, 0.875 -> round 2
    (0.4, 1, 4, 1),
    (0.4, 2, 4, 2),    # round 1 qualifies but is below min_loops; its hazard still counts
    (0.9, 1, 4, 3),
    (0.95, 1, 4, 4),
    (0.95, 1, 3, 3),   # max_loops forces the exit
    (1.0, 1, 4, 4),    # threshold 1 = fixed depth max_loops
    (1.0, 1, 2, 2),
])
def test_q_exit_rounds_by_hand(threshold, min_loops, max_loops, expected):
    g = torch.tensor([[0.0, math.log(3.0), -math.log(3.0), 2.0]])
    assert gates.q_exit_rounds(g, threshold, min_loops, max_loops).item() == expected


@pytest.mark.parametrize("bad", [dict(min_loops=0), dict(min_loops=3, max_loops=2),
                                 dict(max_loops=5), dict(threshold=1.5)])
def test_q_exit_rejects_bad_loops(bad):
    args = dict(threshold=0.5, min_loops=1, max_loops=4) | bad
    with pytest.raises(ValueError):
        gates.q_exit_rounds(torch.randn(3, 4), **args)


# ---------------------------------------------------------------- config validation

@pytest.mark.parametrize("bad", [dict(num_attention_heads=3), dict(hidden_size=0),
                                 dict(early_exit_threshold=1.5), dict(total_ut_steps=0),
                                 dict(tie_word_embeddings=True), dict(bos_token_id=999)])
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        tiny_config(**bad)


def test_config_round_trips_unknown_keys():
    cfg = OuroConfig.from_dict(tiny_config().to_dict() | {"hidden_act": "silu", "foo": 1})
    assert cfg.to_dict()["foo"] == 1 and cfg.to_dict()["hidden_act"] == "silu"


# ---------------------------------------------------------------- gradients

def test_shared_weights_accumulate_gradients_from_every_round():
    """d loss / d W equals the sum of per-round contributions (float64)."""
    model = tiny_model(seed=3)
    ids = torch.randint(0, 53, (2, 7), generator=torch.Generator().manual_seed(0))
    weight = model.model.layers[1].mlp.up_proj.weight

    def loss_fn():
        out = model(ids, all_logits=True)
        return sum(lg.logsumexp(-1).sum() * (r + 1) for r, lg in enumerate(out.logits))

    loss_fn().backward()
    total = weight.grad.clone()
    # Per-round contribution: perturbing the weight only in round r. Done by wrapping the
    # layer so round r sees W + dW (dW with requires_grad) and other rounds see W.
    per_round = []
    layer = model.model.layers[1].mlp.up_proj
    original_forward = layer.forward
    for target in range(4):
        delta = torch.zeros_like(weight, requires_grad=True)
        calls = {"n": 0}

        def patched(x, target=target, delta=delta, calls=calls):
            use = delta if calls["n"] == target else torch.zeros_like(delta)
            calls["n"] += 1
            return torch.nn.functional.linear(x, layer.weight + use)
        layer.forward = patched
        loss_fn().backward()
        per_round.append(delta.grad.clone())
        layer.forward = original_forward
    assert all(g.abs().sum() > 0 for g in per_round), "every round must contribute"
    assert torch.allclose(total, sum(per_round), atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.k_proj.weight",
                                  "model.layers.0.post_attention_layernorm_2.weight",
                                  "model.early_exit_gate.weight"])
def test_gradcheck_tiny_config(name):
    """Analytic vs numeric gradients of the Stage I objective through all rounds (float64)."""
    model = tiny_model(seed=5, hidden_size=8, intermediate_size=8, num_attention_heads=2,
                       num_key_value_heads=1, vocab_size=11, num_hidden_layers=1)
    ids = torch.randint(0, 11, (1, 4), generator=torch.Generator().manual_seed(1))

    def stage1_loss(weight):
        out = torch.func.functional_call(model, {name: weight}, (ids,),
                                         {"all_logits": True})
        probs = gates.exit_distribution(out.gate_logits)
        ce = torch.stack([torch.nn.functional.cross_entropy(lg[0, :-1], ids[0, 1:],
                                                            reduction="none")
                          for lg in out.logits], -1)
        return (probs[0, :-1] * ce).sum()

    weight = dict(model.named_parameters())[name].detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(stage1_loss, (weight,), eps=1e-6, atol=1e-6)


# ---------------------------------------------------------------- LAST_EXITED semantics

def naive_last_exited(model: OuroForCausalLM, ids: list[int], exits: list[int]) -> torch.Tensor:
    """Position-by-position reference: explicit planes, explicit copies. Returns final logits."""
    cfg = model.config
    R, L, Hq, Hkv, D = (cfg.total_ut_steps, cfg.num_hidden_layers, cfg.num_attention_heads,
                        cfg.num_key_value_heads, cfg.head_dim)
    planes_k = [[[] for _ in range(L)] for _ in range(R)]
    planes_v = [[[] for _ in range(L)] for _ in range(R)]
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D))

    def rope(x, pos):  # x [H, D]
        ang = pos * inv_freq  # fp32 angles, like HF: cos/sin are cast to the model dtype
        cos = torch.cat([ang.cos(), ang.cos()]).to(x.dtype)
        sin = torch.cat([ang.sin(), ang.sin()]).to(x.dtype)
        return x * cos + torch.cat([-x[:, D // 2:], x[:, :D // 2]], -1) * sin

    def norm(x, w):
        return w * (x / torch.sqrt((x * x).mean() + cfg.rms_norm_eps))

    out = []
    for pos, (tok, e) in enumerate(zip(ids, exits)):
        h = model.model.embed_tokens.weight[tok]
        for d in range(e):
            x = h
            for li, layer in enumerate(model.model.layers):
                a = layer.self_attn
                xn = norm(x, layer.input_layernorm.weight)
                q = rope((a.q_proj.weight @ xn).view(Hq, D), pos)
                planes_k[d][li].append(rope((a.k_proj.weight @ xn).view(Hkv, D), pos))
                planes_v[d][li].append((a.v_proj.weight @ xn).view(Hkv, D))
                K, V = torch.stack(planes_k[d][li]), torch.stack(planes_v[d][li])  # [P, Hkv, D]
                heads = []
                for hq in range(Hq):
                    kv = hq // (Hq // Hkv)
                    w = torch.softmax(K[:, kv] @ q[hq] / math.sqrt(D), dim=0)
                    heads.append(w @ V[:, kv])
                x = x + norm(a.o_proj.weight @ torch.cat(heads), layer.input_layernorm_2.weight)
                m = layer.mlp
                xn = norm(x, layer.post_attention_layernorm.weight)
                y = m.down_proj.weight @ (torch.nn.functional.silu(m.gate_proj.weight @ xn)
                                          * (m.up_proj.weight @ xn))
                x = x + norm(y, layer.post_attention_layernorm_2.weight)
            h = norm(x, model.model.norm.weight)
        for d in range(e, R):   # LAST_EXITED: deeper planes get this token's round-e K/V
            for li in range(L):
                planes_k[d][li].append(planes_k[e - 1][li][pos])
                planes_v[d][li].append(planes_v[e - 1][li][pos])
        out.append(model.lm_head.weight @ h)
    return torch.stack(out)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_teacher_forced_last_exited_matches_naive_reference(seed):
    model = tiny_model(seed=seed)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 53, (9,), generator=gen)
    exits = torch.randint(1, 5, (9,), generator=gen)
    ref = naive_last_exited(model, ids.tolist(), exits.tolist())
    with torch.no_grad():
        out = model(ids[None], exit_rounds=exits[None])
    assert (out.exit_rounds[0] == exits).all()
    torch.testing.assert_close(out.final_logits[0], ref, atol=1e-10, rtol=1e-9)


def test_exit_pattern_changes_later_tokens():
    """Mixed-depth KV must matter: the same last token sees different context versions."""
    model = tiny_model(seed=4)
    ids = torch.randint(0, 53, (1, 8), generator=torch.Generator().manual_seed(2))
    full = model(ids).final_logits[0, -1]
    early = torch.full_like(ids, 4)
    early[0, 2:6] = 1
    mixed = model(ids, exit_rounds=early).final_logits[0, -1]
    assert (full - mixed).abs().max() > 1e-3


def test_incremental_cache_equals_teacher_forced():
    model = tiny_model(seed=6)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 53, (2, 11), generator=gen)
    exits = torch.randint(1, 5, (2, 11), generator=gen)
    exits[:, :4] = 4
    with torch.no_grad():
        full = model(ids, exit_rounds=exits).final_logits
        cache = LoopedKVCache(model.config, 2, 16, torch.float64)
        steps = [model(ids[:, :4], cache=cache).final_logits]
        for t in range(4, 11):
            steps.append(model(ids[:, t:t + 1], cache=cache,
                               exit_rounds=exits[:, t:t + 1]).final_logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-10, rtol=1e-9)


def test_bf16_forward_is_close_to_fp32():
    model = tiny_model(seed=7, dtype=torch.float32)
    ids = torch.randint(0, 53, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model(ids).final_logits
        low = model.to(torch.bfloat16)(ids).final_logits.float()
    assert low.dtype == torch.float32 and torch.isfinite(low).all()
    rel = (low - ref).norm() / ref.norm()
    assert rel < 3e-2, rel


def test_exit_rounds_are_validated():
    model = tiny_model()
    ids = torch.zeros(1, 3, dtype=torch.long) + 5
    with pytest.raises(ValueError, match="exit_rounds"):
        model(ids, exit_rounds=torch.tensor([[1, 5, 2]]))
    with pytest.raises(ValueError, match="shape"):
        model(ids, exit_rounds=torch.tensor([[1, 2]]))
