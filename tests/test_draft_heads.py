"""Draft components: exact at init, every adapter parameter trains, PEFT save/load round trip,
compatibility checks of the loader, lossless speculative decoding with a trained component."""
import json

import pytest
import torch

from rltlab.config import OuroConfig
from rltlab.draft_heads import build_component, component_kwargs, save_component
from rltlab.draft_heads.train import distill, evaluate
from rltlab.engine.speculative import speculative_generate
from rltlab.engine_patches.loop_draft import IncompatibleDraftComponent, load_draft_component
from rltlab.generate import generate_plain
from rltlab.model import OuroForCausalLM

torch.set_num_threads(1)
KINDS = ["residual_mlp", "lora_lm_head", "layer_lora"]


def _model(seed=0):
    cfg = OuroConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=2, total_ut_steps=4,
                     max_position_embeddings=256)
    return OuroForCausalLM(cfg).init_weights(seed, std=0.3).eval()


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def rows():
    return torch.randint(0, 48, (16, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kind", KINDS)
def test_untrained_component_is_the_shallow_drafter(model, rows, kind):
    comp = build_component(kind, model, draft_rounds=2)
    with torch.no_grad():
        out = model(rows[:2])
        shallow = model.lm_head(out.hidden_states[1])
        drafted = (comp.draft_logits(rows[:2]) if kind == "layer_lora"
                   else comp(out.hidden_states[1]))
    torch.testing.assert_close(drafted, shallow, atol=1e-5, rtol=1e-5)
    assert comp.reuse_exact == (kind != "layer_lora")


@pytest.mark.parametrize("kind", KINDS)
def test_every_adapter_parameter_gets_a_gradient_and_base_stays(model, rows, kind, tmp_path):
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    flags = [p.requires_grad for p in model.parameters()]
    comp = build_component(kind, model, draft_rounds=1)
    grads = []
    # steps=2: zero-initialised B / down matrices give their partners a gradient from step 2 on
    distill(model, comp, rows, steps=2, batch_size=4, lr=1e-2, log_every=1,
            log_fn=lambda row: grads.append([p.grad is not None and bool(p.grad.abs().sum() > 0)
                                             for p in comp.adapter_parameters()]))
    assert comp.adapter_parameters() and all(grads[-1]), grads
    after = model.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)    # base model untouched
    assert [p.requires_grad for p in model.parameters()] == flags
    out = save_component(comp, model, tmp_path / kind)
    meta = json.loads((out / "draft_component.json").read_text())
    assert meta["kind"] == kind and meta["draft_rounds"] == 1
    if kind != "residual_mlp":
        assert (out / "peft" / "adapter_config.json").is_file()
        assert (out / "peft" / "adapter_model.safetensors").is_file()
    loaded = load_draft_component(out, model)
    h = torch.randn(3, 32)
    with torch.no_grad():
        if kind == "layer_lora":
            torch.testing.assert_close(loaded.draft_logits(rows[:2]), comp.draft_logits(rows[:2]))
            assert not torch.allclose(comp.draft_logits(rows[:2]),
                                      model(rows[:2], exit_rounds=torch.ones_like(rows[:2]))
                                      .final_logits)
        else:
            torch.testing.assert_close(loaded(h), comp(h))
            assert not torch.allclose(comp(h), model.lm_head(h))
    # lossless at T=0 with the trained component
    prompts = [rows[0, :4].tolist(), rows[1, :2].tolist()]
    ref = generate_plain(model, prompts, 10, depth=4)
    spec = speculative_generate(model, prompts, 10, k=3, **component_kwargs(loaded))
    assert spec.token_ids == ref.token_ids
    ev = evaluate(model, comp, rows[:4])
    assert 0 <= ev["agree"] <= 1 and ev["acc@2"] <= ev["acc@1"]


def test_loader_refuses_other_models(model, tmp_path):
    comp = build_component("residual_mlp", model, draft_rounds=1)
    out = save_component(comp, model, tmp_path / "head")
    with pytest.raises(IncompatibleDraftComponent, match="base_model_hash"):
        load_draft_component(out, _model(seed=1))
    with pytest.raises(IncompatibleDraftComponent, match="draft_rounds"):
        load_draft_component(out, model, draft_rounds=2)
    other = OuroForCausalLM(OuroConfig(vocab_size=40, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=2,
                                       num_key_value_heads=2, total_ut_steps=4))
    with pytest.raises(IncompatibleDraftComponent, match="vocab_size"):
        load_draft_component(out, other)
    with pytest.raises(FileNotFoundError):
        load_draft_component(tmp_path, model)


def test_save_component_records_digests_and_replaces_an_earlier_component(model, tmp_path):
    from rltlab.draft_heads.heads import component_files_ok
    out = tmp_path / "comp"
    save_component(build_component("lora_lm_head", model, draft_rounds=1), model, out)
    assert component_files_ok(out) and (out / "peft" / "adapter_model.safetensors").is_file()
    save_component(build_component("residual_mlp", model, draft_rounds=1), model, out)
    meta = json.loads((out / "draft_component.json").read_text())
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert files == ["draft_component.json", "head.safetensors"] == sorted(
        ["draft_component.json", *meta["files"]])          # the LoRA files are gone, no temps
    assert component_files_ok(out) and load_draft_component(out, model).kind == "residual_mlp"
    (out / "head.safetensors").write_bytes((out / "head.safetensors").read_bytes()[:-4])
    assert not component_files_ok(out)                     # torn weights: not a finished one
    (out / "draft_component.json").unlink()
    assert not component_files_ok(out)
