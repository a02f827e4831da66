"""Pretraining recipe of the embedded default model (artifacts/ouro-tiny): Stage I + Stage II.

Stage I (all weights): L = sum_r p(r) CE_r + beta KL(p || pi); p = exit distribution of the gate
(fp32), CE_r = next-token CE of lm_head(h_r) at every round; beta_start for the first half, beta_end
after. The prior pi_r is proportional to depth_prior^(r-1): depth_prior 1 is the uniform prior,
where beta KL(p || pi) = -beta H(p) + const is Ouro's entropy term; depth_prior > 1 favours deep
exits (Ouro's prior ablation, the other way round), so round R's loss weighs more than round R-1's
and the shared layers keep refining through the last round instead of settling one round early.
Stage II (gate only, LM frozen): I_r = max(0, CE_{r-1} - CE_r), w_r = sigmoid(slope (I_r - margin)),
BCE between the continue probability 1 - lambda_r and w_r for r = 2..R. Round 1 has no I_1; its
hazard (the same shared gate applied to h_1) gets the label of the step it decides on, w_2:
"exit after round 1 iff round 2 brings no improvement".

Data (rltlab.pretrain.data): Python source (stdlib + installed packages, by content digest), word
problems and k-hop binding problems (rltlab.pretrain.tasks), packed once as a
token tensor ([data_dir]/train_tokens.npz, with tokenizer.json and the eval files beside it).
Resumable: [out_dir]/train_state/state.pt every save_every steps (atomic), reloaded on a re-run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rltlab.common.device import default_device, device_problem
from rltlab.pretrain import data as D
from rltlab.model import gates
from rltlab.pretrain import evaluate as E
from rltlab.pretrain import prepare as P
from rltlab.pretrain import run_state as S
from rltlab.model.config import OuroConfig
from rltlab.model.architecture import OuroForCausalLM, apply_rope, rope_cos_sin

SMOKE = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=32,
             intermediate_size=128, vocab_size=512, tokenizer_bytes=300_000, text_bytes=150_000,
             package_bytes=150_000, eval_hops=20,
             seq_len=128, steps=40, batch_size=8, warmup_steps=5, lr=3e-3, stage2_steps=6,
             eval_text_bytes=3_000, eval_problems=8, log_every=5, save_every=20, device="cpu")
# Fields that may differ between a run and its resumption.
_RUNTIME = {"out_dir", "data_dir", "device", "compile", "log_every", "save_every", "eval_every",
            "stop_after", "time_budget_s", "final_eval", "data_workers"}


@dataclasses.dataclass
class PretrainConfig:
    out_dir: str = "runs/ouro-tiny"
    data_dir: str | None = None  # tokenizer, tokens, eval files; default out_dir/train_state/data
    hidden_size: int = 384
    num_layers: int = 3
    num_rounds: int = 4
    num_heads: int = 6
    num_kv_heads: int = 6
    head_dim: int = 64
    intermediate_size: int = 1024
    max_position_embeddings: int = 1024
    rope_theta: float = 10_000.0
    vocab_size: int = 1024
    tokenizer_bytes: int = 8_000_000  # half stdlib, half installed packages
    text_bytes: int | None = None  # stdlib train text in the tensor (None: all of it, once)
    package_bytes: int = 320_000_000  # installed packages' source (rltlab.pretrain.corpus)
    arith_frac: float = 0.1  # share of a row's tokens that are word problems
    hop_frac: float = 0.25  # ... and k-hop binding problems
    hops_min: int = 1
    hops_max: int = 10
    bare_frac: float = 0.1  # rows that are a bare text window (no leading token 0)
    seq_len: int = 512
    eval_text_bytes: int = 16_000
    eval_problems: int = 100
    eval_hops: int = 400
    unseen_code_dir: str | None = None  # tests/data/unseen_code: eval/unseen_code.txt
    data_workers: int = 1  # processes for tokenization and problem generation
    steps: int = 2000  # Stage I steps; 0 = fit into time_budget_s (measured during warmup)
    time_budget_s: float | None = None
    batch_size: int = 256
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    beta_start: float = 0.1
    beta_end: float = 0.05
    depth_prior: float = 1.0  # pi_r ~ depth_prior^(r-1) in beta KL(p || pi); 1 = Ouro's uniform
    stage2_steps: int = 300
    stage2_lr: float = 3e-3
    stage2_slope: float = 50.0
    stage2_margin: float = 0.005
    seed: int = 0
    device: str = "auto"
    dtype: str = "bf16"  # autocast dtype on CUDA (CPU always runs fp32)
    compile: str = "none"  # none | layer (torch.compile the decoder layer: ~3x faster on a GPU)
    log_every: int = 50
    save_every: int = 500
    eval_every: int = 0
    stop_after: int | None = None  # stop (state saved) after this many steps: tests, preemption
    final_eval: bool = True
    smoke: bool = False

    def __post_init__(self):
        positive = ("hidden_size", "num_layers", "num_rounds", "num_heads", "num_kv_heads",
                    "head_dim", "intermediate_size", "seq_len", "batch_size", "log_every",
                    "save_every", "eval_problems", "lr", "stage2_lr")
        not_positive = [n for n in positive if not getattr(self, n) > 0]
        device_issue = None if self.device == "auto" else device_problem(self.device)
        rules = [(not not_positive, f"{', '.join(not_positive)} must be positive"),
                 (min(self.steps, self.stage2_steps, self.warmup_steps) >= 0, "negative steps"),
                 (self.steps > 0 or (bool(self.time_budget_s) and self.warmup_steps >= 10),
                  "steps=0 (auto) needs time_budget_s and warmup_steps >= 10"),
                 (self.steps == 0 or self.warmup_steps < self.steps, "warmup_steps >= steps"),
                 (self.seq_len <= self.max_position_embeddings, "seq_len > max positions"),
                 (self.vocab_size >= 257, "vocab_size < 257 (byte alphabet + EOT)"),
                 (0 < self.arith_frac + self.hop_frac < 1 and min(self.arith_frac, self.hop_frac)
                  >= 0 and 0 <= self.bare_frac < 1 and 0 <= self.min_lr_ratio <= 1,
                  "fraction range"),
                 (self.depth_prior > 0, "depth_prior must be positive"),
                 (1 <= self.hops_min <= self.hops_max <= 20, "hops range outside 1..20"),
                 (self.package_bytes >= 0 and self.data_workers >= 1, "package_bytes/workers"),
                 (self.dtype in ("bf16", "fp32"), "dtype must be bf16|fp32"),
                 (self.compile in ("none", "layer"), "compile must be none|layer"),
                 (device_issue is None, f"device: {device_issue}"),
                 (not self.unseen_code_dir or P.unseen_code_files(self.unseen_code_dir),
                  f"unseen_code_dir {self.unseen_code_dir!r} holds no .py files")]
        for ok, why in rules:
            if not ok:
                raise ValueError(f"invalid PretrainConfig: {why}")

    def model_config(self, vocab_size: int) -> OuroConfig:
        return OuroConfig(vocab_size=vocab_size, hidden_size=self.hidden_size,
                          intermediate_size=self.intermediate_size,
                          num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
                          num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
                          max_position_embeddings=self.max_position_embeddings,
                          rope_theta=self.rope_theta, total_ut_steps=self.num_rounds,
                          bos_token_id=D.EOT_ID, eos_token_id=D.EOT_ID)


def _layer(layer, h, cos, sin):
    """One decoder layer of OuroForCausalLM for a full causal sequence (no cache, no exits)."""
    attn, (bsz, seq, _) = layer.self_attn, h.shape
    x = layer.input_layernorm(h)
    q, k, v = (proj(x).view(bsz, seq, -1, attn.head_dim).transpose(1, 2)
               for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                         enable_gqa=attn.num_heads != attn.num_kv_heads)
    h = h + layer.input_layernorm_2(attn.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1)))
    return h + layer.post_attention_layernorm_2(layer.mlp(layer.post_attention_layernorm(h)))


def looped_forward(model: OuroForCausalLM, ids: torch.Tensor, layer_fn=_layer):
    """h_r for r = 1..R and gate logits [B, T, R] (fp32): the same computation as
    model(ids, all_logits=True) with every position at every round, with causal flash SDPA."""
    cfg, m = model.config, model.model
    h = m.embed_tokens(ids)
    cos, sin = rope_cos_sin(torch.arange(ids.shape[1], device=ids.device), cfg.head_dim,
                            cfg.rope_theta, h.dtype)
    hs = []
    for _ in range(cfg.num_rounds):
        x = h
        for layer in m.layers:
            x = layer_fn(layer, x, cos, sin)
        h = m.norm(x)
        hs.append(h)
    return hs, torch.stack([m.early_exit_gate(x).float().squeeze(-1) for x in hs], dim=-1)


def round_ce(model, hs, ids):
    """Per-token next-token CE of every round, [B, T-1, R] fp32."""
    return torch.stack([F.cross_entropy(model.lm_head(h[:, :-1]).float().transpose(1, 2),
                                        ids[:, 1:], reduction="none") for h in hs], dim=-1)


def log_depth_prior(num_rounds: int, depth_prior: float) -> torch.Tensor:
    """log pi_r, pi_r proportional to depth_prior^(r-1) (r = 1..num_rounds), fp32."""
    log_pi = torch.arange(num_rounds, dtype=torch.float32) * math.log(depth_prior)
    return log_pi - torch.logsumexp(log_pi, 0)


def stage1_loss(model, ids, beta, layer_fn=_layer, depth_prior: float = 1.0):
    """Stage I: sum_r p(r) CE_r + beta KL(p || pi) (module docstring); returns the loss and the
    detached mean CE per round, mean p per round and mean entropy of p."""
    hs, gate_logits = looped_forward(model, ids, layer_fn)
    ce = round_ce(model, hs, ids)
    p = gates.exit_distribution(gate_logits[:, :-1])
    log_p = p.clamp_min(1e-20).log()
    log_pi = log_depth_prior(p.shape[-1], depth_prior).to(p.device)
    kl = (p * (log_p - log_pi)).sum(-1)
    loss = (p * ce).sum(-1).mean() + beta * kl.mean()
    entropy = -(p * log_p).sum(-1)
    return loss, ce.detach().mean((0, 1)), p.detach().mean((0, 1)), entropy.detach().mean()


def stage2_loss(model, ids, slope: float, margin: float, layer_fn=_layer):
    with torch.no_grad():
        hs, _ = looped_forward(model, ids, layer_fn)
        ce = round_ce(model, hs, ids)
        gain = (ce[..., :-1] - ce[..., 1:]).clamp_min(0)  # I_r for r = 2..R
        w = torch.sigmoid(slope * (gain - margin))
        w = torch.cat([w[..., :1], w], dim=-1)  # round 1 takes round 2's label (module docstring)
    logits = torch.stack([model.model.early_exit_gate(h[:, :-1].detach()).float().squeeze(-1)
                          for h in hs], dim=-1)
    # BCE(1 - lambda_r, w_r) == BCE-with-logits(g_r, 1 - w_r).
    return F.binary_cross_entropy_with_logits(logits, 1.0 - w), ce.mean((0, 1)), w.mean((0, 1))


def _lr(peak, step, steps, warmup, min_ratio):
    """Linear warmup, then cosine from peak to min_ratio * peak at `steps`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, steps - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def pretrain(cfg: PretrainConfig) -> dict:
    """Train (or resume) per cfg; save the bf16 checkpoint + tokenizer + eval files into out_dir."""
    from tqdm.auto import tqdm
    device = torch.device(cfg.device if cfg.device != "auto" else default_device())
    out, t_start = Path(cfg.out_dir), time.time()
    state_dir, log_path = out / "train_state", out / "train_log.jsonl"
    tok, tokens, ddir = P.prepare_data(cfg)
    model = OuroForCausalLM(cfg.model_config(tok.get_vocab_size())).init_weights(cfg.seed)
    model = model.to(device)
    groups = [[], []]  # weight decay on matrices, none on norms and the gate
    for n, p in model.named_parameters():
        groups[p.dim() == 2 and "early_exit_gate" not in n].append(p)
    opt1 = torch.optim.AdamW([{"params": groups[1], "weight_decay": cfg.weight_decay},
                              {"params": groups[0], "weight_decay": 0.0}], lr=cfg.lr,
                             betas=(0.9, 0.95), fused=device.type == "cuda")
    opt2 = torch.optim.AdamW(model.model.early_exit_gate.parameters(), lr=cfg.stage2_lr,
                             weight_decay=0.0)
    step, steps, log = S.resume_state(state_dir, dataclasses.asdict(cfg), _RUNTIME,
                                      dict(model=model, opt1=opt1, opt2=opt2), device)
    amp = dict(device_type=device.type, dtype=torch.bfloat16,
               enabled=device.type == "cuda" and cfg.dtype == "bf16")
    layer_fn = torch.compile(_layer) if cfg.compile == "layer" else _layer
    data, order = tokens.to(device), S.BatchOrder(len(tokens), cfg.batch_size, cfg.seed)
    heldout, body = E.encode(tok, (ddir / P.TEXT_FILE).read_text(encoding="utf-8")), cfg.seq_len - 1
    n_eval = min(len(heldout) // body, 16)  # probe rows: [EOT] + text, like training rows
    held = F.pad(torch.tensor(heldout[: n_eval * body], device=device).view(n_eval, body), (1, 0))

    def snapshot():
        return {"step": step, "steps": steps, "log": log, "config": dataclasses.asdict(cfg),
                "model": model.state_dict(), "opt1": opt1.state_dict(), "opt2": opt2.state_dict()}
    bar = tqdm(total=(steps or 10**9) + cfg.stage2_steps, initial=step, mininterval=2.0)
    t_measure, _ = None, model.train()
    while step < (steps or 10**9) + cfg.stage2_steps:
        stage1 = steps == 0 or step < steps
        ids = data[order(step).to(device)]
        with torch.autocast(**amp):
            if stage1:
                beta = cfg.beta_start if steps == 0 or step < steps // 2 else cfg.beta_end
                loss, ce, p, _ = stage1_loss(model, ids, beta, layer_fn, cfg.depth_prior)
            else:
                loss, ce, p = stage2_loss(model, ids, cfg.stage2_slope, cfg.stage2_margin, layer_fn)
        opt = opt1 if stage1 else opt2
        lr = (_lr(cfg.lr, step, steps, cfg.warmup_steps, cfg.min_lr_ratio) if stage1 else
              _lr(cfg.stage2_lr, step - steps, cfg.stage2_steps, cfg.stage2_steps // 10, 0.1))
        _ = [group.update(lr=lr) for group in opt.param_groups]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        _ = stage1 and torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step, _ = step + 1, bar.update(1)
        if steps == 0 and (t_measure is None or step >= min(cfg.warmup_steps, 40)):
            _ = device.type == "cuda" and torch.cuda.synchronize()  # auto steps: time warmup
            if t_measure is None:  # after the first step (and any compilation)
                t_measure = (time.time(), step)
            else:  # the LR schedule so far did not depend on steps (warmup only)
                per_step = (time.time() - t_measure[0]) / max(1, step - t_measure[1])
                steps = max(cfg.warmup_steps + 1, step + int(
                    0.97 * (cfg.time_budget_s - (time.time() - t_start)) / per_step))
                bar.total = steps + cfg.stage2_steps
                tqdm.write(f"auto steps: {per_step * 1000:.1f} ms/step -> {steps} Stage I steps")
        if step % cfg.log_every == 0 or step == steps or step == steps + cfg.stage2_steps:
            rec = {"step": step, "stage": 1 if stage1 else 2, "lr": lr, "loss": loss.item(),
                   "ce": [round(x, 4) for x in ce.tolist()],
                   "elapsed_s": round(time.time() - t_start, 1)}
            rec["p" if stage1 else "w"] = [round(x, 4) for x in p.tolist()]
            if cfg.eval_every and (step % cfg.eval_every == 0 or step == steps) and n_eval:
                with torch.no_grad(), torch.autocast(**amp):
                    rec["heldout_ce"] = [round(x, 4) for x in
                                         round_ce(model, looped_forward(model, held)[0], held)
                                         .mean((0, 1)).tolist()]
            log.append(rec)
            bar.set_postfix(loss=f"{rec['loss']:.3f}", ce=",".join(f"{c:.2f}" for c in rec["ce"]))
            tqdm.write(json.dumps(rec))
        if step % cfg.save_every == 0 or step == cfg.stop_after:
            S.save_state(state_dir, snapshot(), log_path, log)
        if cfg.stop_after is not None and step >= cfg.stop_after:
            break
    bar.close()
    S.save_state(state_dir, snapshot(), log_path, log)
    result = {"step": step, "steps": steps, "log": log, "out_dir": str(out),
              "train_seconds": round(time.time() - t_start, 1)}
    if step < steps + cfg.stage2_steps:
        return result  # stopped early: the next run resumes
    P.save_artifact(model, cfg, ddir, out, steps)
    if cfg.final_eval:  # of the SAVED (bf16) weights, loaded in fp32 like metrics.json
        result["metrics"] = E.evaluate_checkpoint(out, device=str(device),
                                                  seq_len=min(512, cfg.seq_len))
        print(E.format_table(result["metrics"]), flush=True)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run (< 60 s)")
    parser.add_argument("--prepare-only", action="store_true",
                        help="only build the tokenizer, train tokens and eval files in data_dir")
    kind = {"int": int, "float": float, "bool": lambda s: s.lower() in ("1", "true", "yes")}
    for f in (f for f in dataclasses.fields(PretrainConfig) if f.name != "smoke"):
        parser.add_argument("--" + f.name.replace("_", "-"), default=None,
                            type=kind.get(str(f.type).split(" ")[0], str))


def config_from_args(args: argparse.Namespace) -> PretrainConfig:
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(PretrainConfig)
             if f.name != "smoke" and getattr(args, f.name, None) is not None}
    base = {**SMOKE, "smoke": True} if args.smoke else {}
    return PretrainConfig(**{**base, **given})


def main(args: argparse.Namespace) -> int:
    """-> 0, or 2 after one "error: ..." line for an invalid configuration (nothing written)."""
    try:
        cfg = config_from_args(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    _ = cfg.smoke and torch.set_num_threads(1)  # tiny matrices: threads only add contention
    _ = P.prepare_data(cfg) if getattr(args, "prepare_only", False) else pretrain(cfg)
    return 0
