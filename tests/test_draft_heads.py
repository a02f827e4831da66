"""Draft components: exact at init, every adapter parameter trains, PEFT save/load round trip,
compatibility checks of the loader, lossless speculative decoding with a trained component."""
import json

import pytest
import torch

from rltlab import kernels
from rltlab.model.config import OuroConfig
from rltlab.draft_heads import build_component, component_kwargs, save_component
from rltlab.draft_heads.train import distill, evaluate
from rltlab.model.speculative import speculative_generate
from rltlab.engine_patches.loop_draft import IncompatibleDraftComponent, load_draft_component
from rltlab.model.generate import generate_plain
from rltlab.model.architecture import OuroForCausalLM

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


# ---------------------------------------------- self-distillation (rltlab.draft_heads.selfdistill)
def test_seq_metrics_by_hand():
    from rltlab.draft_heads.selfdistill import seq_metrics
    target = torch.log_softmax(torch.tensor([[[3.0, 0, 0], [0, 3.0, 0], [0, 0, 3.0],
                                              [3.0, 0, 0]]]), -1)
    draft = torch.tensor([[[2.0, 0, 0], [0, 2.0, 0], [2.0, 0, 0], [2.0, 0, 0]]])
    mask = torch.tensor([[True, True, True, False]])      # the 4th position is padding
    m = seq_metrics(draft, target, mask)
    assert m["agree"] == pytest.approx(2 / 3) and m["acc@1"] == pytest.approx(2 / 3)
    assert m["acc@2"] == pytest.approx(1 / 2)             # windows (0,1) ok, (1,2) not
    assert m["acc@3"] == pytest.approx(0.0) and m["acc@4"] == pytest.approx(0.0)
    same = seq_metrics(target, target, mask)
    assert same["kl"] == pytest.approx(0.0, abs=1e-6) and same["accept_t1"] == pytest.approx(1.0)
    assert m["kl"] > 0.1 and m["accept_t1"] < 0.95


def test_rollouts_and_features_match_unpadded_forward(model):
    from rltlab.draft_heads.rollout_data import rollouts, sequence_features
    prompts = [([0, 5, 7, 9], 0), ([0, 3], 1), ([0, 11, 2, 4, 8, 1], 1)]
    seqs = rollouts(model, prompts, max_tokens=5, temperatures=(0.0,), eos_token_id=None,
                    progress=False)
    for ids, kind, i in seqs:
        assert ids[:len(prompts[i][0])] == prompts[i][0] and kind == prompts[i][1]
        ref = generate_plain(model, [prompts[i][0]], 5, depth=4).token_ids[0]
        assert ids[len(prompts[i][0]):] == ref
    feats = sequence_features(model, seqs, (1, 2), heldout_every=2, batch_size=2,
                              progress=False)
    for n, (ids, _, i) in enumerate(seqs):
        with torch.no_grad():
            out = model(torch.tensor([ids]))
        L = len(ids)
        assert feats.mask[n].sum() == L and not feats.mask[n, L:].any()
        torch.testing.assert_close(feats.hidden[2][n, :L], out.hidden_states[1][0],
                                   atol=1e-5, rtol=1e-5)   # fp32; right padding never leaks
        torch.testing.assert_close(feats.final[n, :L], out.final_hidden[0], atol=1e-5,
                                   rtol=1e-5)
        assert feats.final[n, :L].abs().sum() > 0
        assert int(feats.split[n]) == int(i % 2 == 0)


def test_distill_sequences_improves_heldout_and_ships(model, tmp_path):
    from rltlab.draft_heads.rollout_data import rollouts, sequence_features
    from rltlab.draft_heads.selfdistill import distill_sequences, evaluate_features
    from rltlab.engine import LLM, SamplingParams
    from rltlab.engine_patches.loop_draft import load_proposer
    g = torch.Generator().manual_seed(3)
    prompts = [(torch.randint(1, 48, (int(n),), generator=g).tolist(), int(n) % 2)
               for n in torch.randint(2, 8, (40,), generator=g)]
    seqs = rollouts(model, prompts, max_tokens=8, temperatures=(0.0, 1.0), eos_token_id=None,
                    progress=False)
    feats = sequence_features(model, seqs, (1,), heldout_every=5, progress=False)
    held = feats.select((feats.split == 1).nonzero()[:, 0])
    torch.manual_seed(0)
    head = build_component("residual_mlp", model, 1, inner=64)
    base = evaluate_features(None, held, 1, model.lm_head)["all"]
    assert evaluate_features(head, held, 1, model.lm_head)["all"] == pytest.approx(base)
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    log = distill_sequences(head, feats, 1, model.lm_head, steps=120, batch_size=16, lr=3e-3,
                            eval_every=20, progress=False)
    after = evaluate_features(head, held, 1, model.lm_head)["all"]
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())
    assert log[-1]["best_step"] > 0 and after["kl"] < 0.9 * base["kl"], (base, after)
    assert after["kl"] == pytest.approx(min(r["heldout_all_kl"] for r in log))
    assert {"heldout_arithmetic_acc@2", "heldout_text_agree"} <= set(log[-1])
    out = save_component(head, model, tmp_path / "sd")
    prop = load_proposer(out, model, 3)
    llm = LLM(model, max_num_seqs=4, block_size=4)
    ps = [p for p, _ in prompts[:4]]
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, exit_policy="fixed")
    ref = [o.token_ids for o in llm.generate(ps, sp)]
    llm.set_proposer(prop)
    outs = llm.generate(ps, sp)
    assert [o.token_ids for o in outs] == ref and all(o.spec_stats["steps"] > 0 for o in outs)


def test_shipped_components_load_onto_the_embedded_model():
    from rltlab import workbench as W
    from rltlab.draft_heads.selfdistill import shipped_components
    from rltlab.engine_patches.loop_draft import read_metadata
    paths = shipped_components()
    assert paths, "no component under artifacts/ouro-tiny/draft_heads"
    model, _, _ = W.load_model(None)
    for path in paths:
        meta = read_metadata(path)
        comp = load_draft_component(path, model)           # hash, hidden, vocab, d checked
        assert comp.draft_rounds == meta["draft_rounds"] in (1, 2)
        head_params = sum(p.numel() for n, p in comp.named_parameters() if "lm_head" not in n)
        # fp32 weights plus metadata: nothing else ships (the model dir stays under 40 MB)
        assert sum(f.stat().st_size for f in path.rglob("*")) < 4 * head_params + 100_000
        assert "TRAINING-split" in meta["training"]["description"]
        assert meta["training"]["command"].startswith("python -m rltlab.draft_heads.selfdistill")
        m = meta["metrics"]
        assert m["heldout_trained"]["all"]["agree"] > m["heldout_shallow"]["all"]["agree"]
        h = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert not torch.allclose(comp(h), model.lm_head(h), atol=1e-3)


def test_loader_puts_the_component_on_the_models_dtype(model, tmp_path):
    comp = build_component("lora_lm_head", model, draft_rounds=1)
    with torch.no_grad():
        for p in comp.adapter_parameters():
            p.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    out = save_component(comp, model, tmp_path / "head")
    wide = _model().double()
    loaded = load_draft_component(out, wide, check_hash=False)
    assert all(p.dtype == torch.float64 for p in loaded.adapter_parameters())
    h = torch.randn(3, 32, dtype=torch.float64)
    with torch.no_grad():
        got = loaded(h)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got.float(), comp(h.float()), atol=1e-4, rtol=1e-4)
        assert not torch.allclose(got, wide.lm_head(h), atol=1e-3)


@pytest.mark.skipif(not kernels.triton_available("cpu"), reason="needs TRITON_INTERPRET=1")
def test_residual_head_fused_forward_matches_reference(model):
    """The engine's 5-kernel residual-MLP head (Triton RMSNorm, residual add folded into the
    down GEMM) == the reference forward, fp32, on random states and trained-like weights."""
    torch.manual_seed(3)
    head = build_component("residual_mlp", model, draft_rounds=1, inner=96)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
        h = torch.randn(7, model.config.hidden_size) * 2.0
        ref = model.lm_head(h + head.down(torch.nn.functional.silu(head.up(head.norm(h)))))
        fused = head.fused_forward(h)
    assert fused.shape == ref.shape and ref.abs().max() > 1.0
    torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-5)


def test_corpus_prompts_sample_the_files_reproducibly(tmp_path):
    from rltlab import workbench as W
    from rltlab.draft_heads.rollout_data import corpus_prompts, training_prompts
    _, tok, _ = W.load_model(None)
    texts = {f"pkg/m{i}.py": f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 40 for i in range(6)}
    for root in ("a", "b"):                       # the same files under two different roots
        for rel, text in texts.items():
            (tmp_path / root / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / root / rel).write_text(text)
    pa, da = corpus_prompts(tok, [str(tmp_path / "a" / "**" / "*.py")], 50, 12, seed=1)
    pb, db = corpus_prompts(tok, [str(tmp_path / "b" / "**" / "*.py")], 50, 12, seed=1)
    assert pa == pb and da["sha256"] == db["sha256"] and da["files_matched"] == 6
    assert len(pa) == 50 and {len(p) for p in pa} == {13} and len({tuple(p) for p in pa}) > 20
    assert corpus_prompts(tok, [str(tmp_path / "a" / "**" / "*.py")], 50, 12, seed=2)[0] != pa
    every = {t for p in pa for t in p[1:]}
    assert every <= {t for text in texts.values() for t in W.encode(tok, text)} | {0}
    mixed = training_prompts(tok, 2, 3, 12, corpus=pa[:4])
    assert [k for _, k in mixed] == [0, 0, 1, 1, 1, 2, 2, 2, 2] and mixed[-1][0] == pa[3]
    with pytest.raises(ValueError, match="no file matches"):
        corpus_prompts(tok, [str(tmp_path / "nothing" / "*.py")], 5)


def test_text_agreement_rows_compare_drafters_on_both_texts():
    from rltlab import workbench as W
    from rltlab.draft_heads.evaluate import text_agreement
    model, tok, model_dir = W.load_model(None)
    untrained = build_component("residual_mlp", model, draft_rounds=2, inner=32)  # == shallow d=2
    rows = text_agreement(model, tok, model_dir, {"zero-init d=2": untrained}, n=4, max_tokens=6)
    by = {(r["text"], r["drafter"]): r for r in rows}
    assert {t for t, _ in by} == {"held-out eval text", "training-split text"} and len(rows) == 6
    for text in ("held-out eval text", "training-split text"):
        same, d2, d1 = (by[text, k] for k in ("zero-init d=2", "shallow d=2", "shallow d=1"))
        assert same["prompt_agree"] == d2["prompt_agree"]
        assert same["continuation_agree"] == d2["continuation_agree"]
        assert 0 < d1["prompt_agree"] < 1 and d1["prompt_agree"] != d2["prompt_agree"]
def test_selfdistill_writes_into_the_models_own_draft_heads_folder(tmp_path, monkeypatch):
    """Without --out-root the components land in <model>/draft_heads, where shipped_components
    and the benches look, whatever the working directory (tiny run: 8 prompts, 2 steps)."""
    import shutil

    from rltlab.common.paths import embedded_model_dir
    from rltlab.draft_heads import selfdistill
    model_dir = tmp_path / "model"
    shutil.copytree(embedded_model_dir(), model_dir, ignore=shutil.ignore_patterns("draft_heads"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    selfdistill.main(["--model", str(model_dir), "--draft-rounds", "1", "--arith", "4",
                      "--text", "4", "--max-tokens", "4", "--temperatures", "0", "--steps", "2",
                      "--eval-every", "1", "--batch-size", "4"])
    assert selfdistill.shipped_components(model_dir) == [model_dir / "draft_heads" /
                                                         "residual_mlp_d1"]
    assert not any(elsewhere.iterdir())


def test_eval_prompts_from_one_prompt_and_clear_errors_below():
    """eval_prompts(.., 1) is one arithmetic question (it used to ask heldout_text_rows for 0
    rows, which failed with "held-out text too short"); n < 1 and max_rows < 1 say so."""
    from rltlab import workbench as W
    from rltlab.draft_heads.evaluate import EOS, eval_prompt_kinds, eval_prompts
    from rltlab.eval.problems import heldout_text_rows
    _, tok, model_dir = W.load_model(None)
    one, four = eval_prompts(tok, model_dir, 1), eval_prompts(tok, model_dir, 4)
    assert eval_prompt_kinds(1) == ["arithmetic"] and len(one) == 1
    assert one[0][0] == EOS and len(one[0]) > 3
    assert len(four) == 4 and four[2:] == heldout_text_rows(tok, model_dir, 24, 2).tolist()
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        eval_prompts(tok, model_dir, 0)
    with pytest.raises(ValueError, match="max_rows must be >= 1, got 0"):
        heldout_text_rows(tok, model_dir, 24, 0)
