"""rltlab.pretrain.recipe: the training forward, the two losses, config validation, the CPU smoke
run (end to end through the CLI), and resumption from train_state/."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rltlab.model.config import OuroConfig
from rltlab.model.architecture import OuroForCausalLM
from rltlab.pretrain.recipe import (SMOKE, PretrainConfig, looped_forward, pretrain, stage1_loss,
                             stage2_loss)

REPO = Path(__file__).resolve().parents[1]
@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One torch thread for tiny matrices (as the smoke CLI sets its own): under load (CI runs
    two workers on two cores) a second thread only spins. Restored for the worker's next
    module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)



def tiny(kv_heads: int = 2) -> OuroForCausalLM:
    cfg = OuroConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=kv_heads,
                     max_position_embeddings=128, total_ut_steps=4)
    model = OuroForCausalLM(cfg).init_weights(0, std=0.1)
    with torch.no_grad():
        model.model.early_exit_gate.bias.fill_(0.3)
    return model


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_training_forward_is_the_model_forward(kv_heads):
    model = tiny(kv_heads)
    ids = torch.randint(0, 300, (3, 20), generator=torch.Generator().manual_seed(1))
    ref = model(ids, all_logits=True)
    hs, gate_logits = looped_forward(model, ids)
    for h, logits in zip(hs, ref.logits, strict=True):
        torch.testing.assert_close(model.lm_head(h), logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gate_logits, ref.gate_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("depth_prior", [1.0, 3.0])
def test_stage1_loss_matches_formula(depth_prior):
    """sum_r p(r) CE_r + beta KL(p || pi), pi_r ~ depth_prior^(r-1): uniform is Ouro's entropy
    term plus the constant beta log R."""
    model = tiny()
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(2))
    loss, ce, p, entropy = stage1_loss(model, ids, 0.1, depth_prior=depth_prior)
    out = model(ids, all_logits=True)
    lam = torch.sigmoid(out.gate_logits[:, :-1])
    surv = torch.cumprod(1 - lam, -1)
    probs = torch.stack([lam[..., 0], lam[..., 1] * surv[..., 0], lam[..., 2] * surv[..., 1],
                         surv[..., 2]], -1)
    ces = torch.stack([torch.nn.functional.cross_entropy(
        logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none") for logits in out.logits], -1)
    ent = -(probs * probs.log()).sum(-1)
    prior = torch.tensor([depth_prior ** r for r in range(4)])
    prior = prior / prior.sum()
    cross = -(probs * prior.log()).sum(-1)  # KL(p || pi) = cross-entropy(p, pi) - H(p)
    expected = (probs * ces).sum(-1).mean() + 0.1 * (cross - ent).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, ent.mean(), rtol=1e-5, atol=1e-5)
    if depth_prior == 1.0:  # Ouro's -beta H(p), up to the constant beta log R
        torch.testing.assert_close(loss, (probs * ces).sum(-1).mean() - 0.1 * ent.mean()
                                   + 0.1 * torch.log(torch.tensor(4.0)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ce, ces.mean((0, 1)), rtol=1e-5, atol=1e-5)


def test_stage2_trains_only_the_gate_with_round1_taking_round2_label():
    model = tiny()
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(3))
    loss, ce, w = stage2_loss(model, ids, 50.0, 0.005)
    loss.backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads == {"model.early_exit_gate.weight", "model.early_exit_gate.bias"}
    assert w[0] == w[1]
    out = model(ids, all_logits=True)
    ces = torch.stack([torch.nn.functional.cross_entropy(
        logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none") for logits in out.logits], -1)
    gain = (ces[..., :-1] - ces[..., 1:]).clamp_min(0)
    labels = torch.sigmoid(50 * (gain - 0.005))
    labels = torch.cat([labels[..., :1], labels], -1)
    lam = torch.sigmoid(out.gate_logits[:, :-1])
    expected = -(labels * torch.log(1 - lam) + (1 - labels) * torch.log(lam)).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bad", [dict(hidden_size=0), dict(steps=0), dict(dtype="fp16"),
                                 dict(seq_len=2048), dict(vocab_size=100), dict(compile="x"),
                                 dict(warmup_steps=3000)])
def test_config_validation(bad):
    with pytest.raises(ValueError):
        PretrainConfig(**bad)


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_smoke_cli_trains_saves_and_loads(tmp_path):
    """The smoke preset through the CLI with half its Stage I and Stage II steps (a field given
    on the command line overrides the preset's; the loss still falls by more than 0.3)."""
    out = tmp_path / "smoke"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "rltlab.pretrain", "--smoke", "--out-dir",
                           str(out), "--unseen-code-dir", str(REPO / "tests/data/unseen_code"),
                           "--steps", "20", "--stage2-steps", "3"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stage1 = [r for r in _log(out) if r["stage"] == 1]
    assert stage1[-1]["loss"] < stage1[0]["loss"] - 0.3
    assert any(r["stage"] == 2 for r in _log(out))
    from rltlab.model.checkpoint import load_model_and_tokenizer
    model, tokenizer = load_model_and_tokenizer(out, dtype=torch.float32)
    assert model.config.hidden_size == SMOKE["hidden_size"]
    assert {p.name for p in (out / "eval").iterdir()} == {
        "heldout_text.txt", "unseen_code.txt", "arithmetic_heldout.jsonl", "hops_heldout.jsonl"}
    manifest = json.loads((out / "data_manifest.json").read_text())
    assert manifest["packages"]["files"] > 0 and len(manifest["stdlib_train"]["sha256"]) == 64
    saved = json.loads((out / "pretrain_config.json").read_text())
    assert saved["smoke"] is True and (saved["steps"], saved["stage2_steps"]) == (20, 3)
    assert all(saved[k] == v for k, v in SMOKE.items() if k not in ("steps", "stage2_steps"))
    assert "| 4 |" in proc.stdout  # the final per-round eval table


def test_resume_reproduces_an_uninterrupted_run(tmp_path):
    base = dict(SMOKE, smoke=True, steps=6, warmup_steps=2, stage2_steps=2, batch_size=4,
                seq_len=128, save_every=100, log_every=1, final_eval=False,
                data_dir=str(tmp_path / "data"))
    full = pretrain(PretrainConfig(**base, out_dir=str(tmp_path / "a")))
    part = pretrain(PretrainConfig(**base, out_dir=str(tmp_path / "b"), stop_after=3))
    assert part["step"] == 3 and not (tmp_path / "b" / "model.safetensors").exists()
    rest = pretrain(PretrainConfig(**base, out_dir=str(tmp_path / "b")))
    assert rest["step"] == full["step"] == 8
    from safetensors.torch import load_file
    a = load_file(tmp_path / "a" / "model.safetensors")
    b = load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["loss"] for r in full["log"]] == pytest.approx([r["loss"] for r in rest["log"]])
    with pytest.raises(ValueError, match="another config"):
        pretrain(PretrainConfig(**{**base, "lr": 1e-2}, out_dir=str(tmp_path / "b")))


def test_oracle_leaves_out_the_first_answer_token():
    """The oracle exit depth skips each answer's first token (generation takes it from the prefill
    at full depth, docs/ouro.md) while the answer loss still scores it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from rltlab.pretrain import evaluate as E
    vocab = {ch: i + 1 for i, ch in enumerate(" 0123456789=?;abcdQA:\n")}
    tok = Tokenizer(models.WordLevel({**vocab, "<unk>": 0}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    problems = [{"question": "Q: a=3; a=?\nA:", "answer_text": " 3"},
                {"question": "Q: b=45; b=?\nA:", "answer_text": " 45"}]
    prompts, rows, scored, generated = E._answer_rows(tok, problems)
    for q, row, s, g in zip(prompts, rows, scored, generated, strict=True):
        assert len(row) == len(s) == len(g) and sum(s) == len(row) - len(q)
        assert s[len(q)] and not g[len(q)] and g[len(q) + 1:] == s[len(q) + 1:]
    scores = E._round_scores(tiny(), [r[:-1] + [7] for r in rows], scored, 2, generated)
    assert scores["count"] == sum(map(sum, scored)) and scores["oracle_count"] == 5
    assert int(scores["oracle"].sum()) == scores["oracle_count"]


def test_one_prefill_serves_the_answer_scores_and_every_depths_generation():
    """evaluate._task_scores_and_generations (one full-depth prefill per batch of prompts, the
    answers teacher-forced after it, then greedy decoding at each depth from it) gives the
    scores of _round_scores over the [prompt + answer] rows and, per depth, the tokens of
    generate_plain on the same batch."""
    from rltlab.model.generate import generate_plain
    from rltlab.pretrain import evaluate as E
    model = tiny()
    gen = torch.Generator().manual_seed(5)
    prompts = [[0] + torch.randint(1, 300, (n,), generator=gen).tolist() for n in (7, 3, 11, 5, 9)]
    answers = [torch.randint(1, 300, (n,), generator=gen).tolist() + [0] for n in (1, 4, 2, 3, 1)]
    max_new, batch = 6, 2
    scores, tokens = E._task_scores_and_generations(model, prompts, answers, max_new, batch)
    rows = [q + a for q, a in zip(prompts, answers)]
    scored = [[False] * len(q) + [True] * len(a) for q, a in zip(prompts, answers)]
    oracle = [[False] * (len(q) + 1) + [True] * (len(a) - 1) for q, a in zip(prompts, answers)]
    ref = E._round_scores(model, rows, scored, 3, oracle)
    assert (scores["count"], scores["oracle_count"]) == (ref["count"], ref["oracle_count"]) \
        == (sum(map(len, answers)), sum(map(len, answers)) - len(answers))
    torch.testing.assert_close(scores["nll"], ref["nll"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scores["exit_mass"], ref["exit_mass"], rtol=1e-5, atol=1e-6)
    assert torch.equal(scores["oracle"], ref["oracle"])
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for depth in range(1, 5):
        for start in range(0, len(order), batch):
            index = order[start:start + batch]
            plain = generate_plain(model, [prompts[i] for i in index], max_new, depth=depth,
                                   eos_token_id=0).token_ids
            assert [tokens[depth - 1][i] for i in index] == plain, (depth, index)
    assert len({tuple(t) for t in tokens[0]} | {tuple(t) for t in tokens[3]}) > 5   # depth matters


def test_rounds_command_refuses_a_bad_device_or_checkpoint_in_one_line(tmp_path, capsys,
                                                                          monkeypatch):
    """`rltlab rounds` with a device string torch rejects or CUDA where there is none (nothing
    is evaluated), or a checkpoint directory that is missing or holds no tokenizer: exit 2 and
    one "error:" line naming the problem."""
    from rltlab.pretrain import rounds
    from rltlab.workbench.cli import build_parser
    real, evaluated = rounds.evaluate_checkpoint, []

    def recording(path, **kwargs):
        evaluated.append(path)
        return real(path, **kwargs)
    monkeypatch.setattr(rounds, "evaluate_checkpoint", recording)
    empty = tmp_path / "empty"
    empty.mkdir()
    devices = {"nosuch": "is not a torch device"}
    if not torch.cuda.is_available():
        devices["cuda"] = "CUDA is not available"
    checkpoints = {str(tmp_path / "missing"): "does not exist",
                   str(empty): "has no tokenizer.json"}
    cases = [(("--device", d), words) for d, words in devices.items()] + \
        [(("--model", m), words) for m, words in checkpoints.items()]
    for argv, words in cases:
        args = build_parser("rounds").parse_args(["rounds", *argv])
        assert rounds.main(args) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], (argv, err)
    assert evaluated == list(checkpoints)   # the bad devices stopped before it


def test_pretrain_command_refuses_a_bad_config_in_one_line_and_writes_nothing(tmp_path, capsys):
    """`rltlab pretrain` with fields out of range (each one named), a device torch rejects or
    an unseen-code directory without .py files: exit 2, one "error:" line, and no output
    directory, before any data is prepared."""
    from rltlab.pretrain import recipe
    from rltlab.workbench.cli import build_parser
    cases = {("--hidden-size", "0", "--lr", "0"): "hidden_size, lr must be positive",
             ("--device", "nosuch"): "device: 'nosuch' is not a torch device",
             ("--unseen-code-dir", str(tmp_path / "nowhere")): "holds no .py files"}
    for i, (argv, words) in enumerate(cases.items()):
        out = tmp_path / f"run{i}"
        args = build_parser("pretrain").parse_args(["pretrain", "--out-dir", str(out), *argv])
        assert recipe.main(args) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], (argv, err)
        assert not out.exists(), argv
