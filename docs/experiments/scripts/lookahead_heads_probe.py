"""Issue 16, the 2.0x lossless goal at c = 1: would Medusa-style lookahead heads on the FINAL
round's state (drafts free from the previous verification pass, one full-depth pass per
iteration) draft better than the shipped sequential d = 1 head? At c = 1 the GPU is
launch-bound, so such an iteration costs about one target token, and 2.0x would need tau >= ~2.5
at K <= 4. Answer on model v4 (CPU probe, 2026-12-03): no. Teacher-forced on 288 held-out
greedy rollouts, heads k = 1..4 (residual MLP + the frozen lm_head, on h_4 alone or with the
embedding of x_{t+1}) reach tau 1.82 / 1.98 at K = 4, against 2.11 for the shipped d = 1 head.
Data: docs/experiments/data/2026-12-03-lookahead-heads-probe-cpu.json (docs/experiments/
loop_speculation.md). Run from the repository root, one CPU thread, ~20 minutes:

    python docs/experiments/scripts/lookahead_heads_probe.py gen    # rollouts -> $PROBE_OUT/data.pt
    python docs/experiments/scripts/lookahead_heads_probe.py train  # -> $PROBE_OUT/result.json
"""
import json, math, sys, time
from pathlib import Path
import torch
import torch.nn.functional as F
from torch import nn

torch.set_num_threads(1)
import os
OUT = Path(os.environ.get("PROBE_OUT", "/tmp/lookahead_probe"))
MD = "artifacts/ouro-tiny"
N_ARITH, N_TEXT, N_HELD = (int(x) for x in os.environ.get('PROBE_N', '1000,2200,288').split(','))
MAX_NEW, EOS = 32, 0
KMAX = 4


@torch.no_grad()
def greedy_capture(model, prompts, max_new=MAX_NEW, batch_size=128, want_h1=False,
                   device="cpu"):
    """Greedy full-depth decoding (same steps as rltlab.model.generate.generate_plain, T=0,
    eos=0) that keeps h_4 of the position predicting each new token (positions P-1..P+L-2) and,
    optionally, h_1 of positions P..P+L-1 (round-1 state of each generated token)."""
    from rltlab.model.architecture import LoopedKVCache
    from rltlab.model.generate import left_pad
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    res = [None] * len(prompts)
    for lo in range(0, len(order), batch_size):
        idx = order[lo:lo + batch_size]
        ps = [prompts[i] for i in idx]
        bsz, width = len(ps), max(map(len, ps))
        ids, key_mask, positions = left_pad(ps, 0, device)
        cache = LoopedKVCache(model.config, bsz, width + max_new, torch.float32, device)
        out = model(ids, positions=positions, key_mask=key_mask, cache=cache)
        next_pos = positions[:, -1] + 1
        h4s, h1s, toks = [out.final_hidden[:, -1]], [], []
        logits = out.final_logits[:, -1]
        done = torch.zeros(bsz, dtype=torch.bool, device=device)
        for step in range(max_new):
            tok = logits.argmax(-1)
            toks.append(tok)
            done |= tok == EOS
            if bool(done.all()) or step == max_new - 1:
                break
            out = model(tok[:, None], positions=(next_pos + step)[:, None], cache=cache)
            logits = out.final_logits[:, -1]
            h4s.append(out.final_hidden[:, -1])
            h1s.append(out.hidden_states[0][:, -1])
        T = torch.stack(toks, 1).cpu()
        H4 = torch.stack(h4s, 1).cpu()
        H1 = torch.stack(h1s, 1).cpu() if h1s else None
        for r, i in enumerate(idx):
            t = T[r].tolist()
            L = next((j + 1 for j, x in enumerate(t) if x == EOS), len(t))
            res[i] = {"y": torch.tensor(t[:L]), "h4": H4[r, :L].clone(),
                      "h1": H1[r, :L - 1].clone() if (want_h1 and H1 is not None) else None}
        print(f"  gen {lo + bsz}/{len(prompts)}", flush=True)
    return res


def gen():
    from rltlab.model.checkpoint import load_model
    from rltlab.draft_heads.rollout_data import training_prompts
    from rltlab.draft_heads.evaluate import eval_prompts, eval_prompt_kinds
    from rltlab.model.generate import generate_plain
    model, tok, md = load_model(MD, dtype="float32", device="cpu")
    model.eval()
    t0 = time.time()
    held = eval_prompts(tok, md, N_HELD)
    hk = [0 if k == "arithmetic" else 1 for k in eval_prompt_kinds(N_HELD)]
    e32 = eval_prompts(tok, md, 32)
    in32 = [p in e32 for p in held]
    hres = greedy_capture(model, held, want_h1=True)
    # sanity: tokens identical to the repo's generate_plain (batched) on the 32 eval prompts
    ref = generate_plain(model, e32, MAX_NEW, temperature=0.0, eos_token_id=EOS).token_ids
    mine = {tuple(p): r["y"].tolist() for p, r in zip(held, hres)}
    same = sum(mine[tuple(p)] == r for p, r in zip(e32, ref))
    print("held-out gen", time.time() - t0, "identical to generate_plain on eval32:", same, "/32")
    tp = training_prompts(tok, N_ARITH, N_TEXT, 24, 0)
    t1 = time.time()
    tres = greedy_capture(model, [p for p, _ in tp], batch_size=128)
    print("train gen", time.time() - t1)
    torch.save({"train": [(r["y"], r["h4"], k) for r, (_, k) in zip(tres, tp)],
                "held": [(r["y"], r["h4"], r["h1"], k, i32) for r, k, i32 in zip(hres, hk, in32)],
                "gen_seconds": time.time() - t0, "eval32_identical": same,
                "n_train_prompts": len(tp)}, OUT / "data.pt")


if __name__ == "__main__" and sys.argv[1] == "gen":
    gen()


# ----------------------------------------------------------------------------- training / eval
INNER, BATCH, LR = 1024, 512, 1e-3
TRAIN_SECONDS = float(os.environ.get("TRAIN_SECONDS", 660))


class LookaheadHead(nn.Module):
    """logits = lm_head(h + down(silu(up([norm(h) (, norm_e(emb(x_{t+1})))])))), down zero-init,
    lm_head (and the embedding) frozen and shared with the model."""
    def __init__(self, model, use_emb: bool, inner=INNER):
        super().__init__()
        from rltlab.model.architecture import RMSNorm
        H, eps = model.config.hidden_size, model.config.rms_norm_eps
        self.use_emb = use_emb
        self.norm = RMSNorm(H, eps)
        self.norm_e = RMSNorm(H, eps) if use_emb else None
        self.up = nn.Linear(H * (2 if use_emb else 1), inner, bias=False)
        self.down = nn.Linear(inner, H, bias=False)
        nn.init.normal_(self.up.weight, std=H ** -0.5)
        nn.init.zeros_(self.down.weight)
        self._lm = [model.lm_head]
        self._emb = [model.model.embed_tokens]

    def forward(self, h, nxt):
        x = self.norm(h)
        if self.use_emb:
            x = torch.cat([x, self.norm_e(self._emb[0](nxt))], -1)
        return self._lm[0](h + self.down(F.silu(self.up(x))))


def flatten(seqs):
    """-> h [N,H], nxt [N] (= x_{t+1}, the verified/bonus token), tgt [N,KMAX] (x_{t+1+k},
    -100 past the end of the rollout), kind [N], seq id [N]."""
    hs, nx, tg, kd, sid = [], [], [], [], []
    for s, seq in enumerate(seqs):
        y, h4, kind = seq[0], seq[1], (seq[2] if len(seq) == 3 else seq[3])
        L = len(y)
        t = torch.full((L, KMAX), -100, dtype=torch.long)
        for k in range(1, KMAX + 1):
            if L > k:
                t[:L - k, k - 1] = y[k:]
        hs.append(h4); nx.append(y); tg.append(t)
        kd.append(torch.full((L,), kind)); sid.append(torch.full((L,), s))
    return torch.cat(hs), torch.cat(nx), torch.cat(tg), torch.cat(kd), torch.cat(sid)


@torch.no_grad()
def predict(head, h, nxt, bs=4096, topk=3):
    return torch.cat([head(h[i:i + bs], nxt[i:i + bs]).topk(topk, -1).indices
                      for i in range(0, len(h), bs)])


def lead(matches_row, K):
    n = 0
    for m in matches_row[:K]:
        if not m:
            break
        n += 1
    return n


def tau_stats(seq_matches, K):
    """seq_matches: per sequence, list over iteration start i of the list of draft matches
    (True/False, already capped at the rollout end). -> position-mean tau and walk tau."""
    pos, n_pos, toks, iters = 0.0, 0, 0, 0
    for ms in seq_matches:
        L = len(ms)
        for i in range(L):
            pos += 1 + lead(ms[i], K); n_pos += 1
        i = 0
        while i < L:
            i += 1 + lead(ms[i], K); iters += 1
        toks += L
    return {"tau_posmean": pos / max(n_pos, 1), "tau_walk": toks / max(iters, 1)}


def train():
    from rltlab.model.checkpoint import load_model
    from rltlab.engine_patches.loop_draft import load_draft_component
    model, tok, md = load_model(MD, dtype="float32", device="cpu")
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    data = torch.load(OUT / "data.pt")
    train_seqs = [s for i, s in enumerate(data["train"]) if i % 20 != 0]
    val_seqs = [s for i, s in enumerate(data["train"]) if i % 20 == 0]
    H, NX, TG, KD, _ = flatten(train_seqs)
    vH, vNX, vTG, _, _ = flatten(val_seqs)
    sizes = {"train_prompts": len(train_seqs), "val_prompts": len(val_seqs),
             "train_positions": len(H), "train_positions_arith": int((KD == 0).sum()),
             "train_positions_text": int((KD == 1).sum()),
             "train_targets_per_head": [int((TG[:, k] >= 0).sum()) for k in range(KMAX)],
             "val_positions": len(vH)}
    print(sizes, flush=True)
    torch.manual_seed(0)
    heads = {(v, k): LookaheadHead(model, v == "h+emb") for v in ("h", "h+emb")
             for k in range(1, KMAX + 1)}
    params = [p for hd in heads.values() for p in hd.parameters()]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.01)
    gen = torch.Generator().manual_seed(0)
    best = {key: (-1.0, None, 0) for key in heads}
    log, step, t0 = [], 0, time.time()

    def val_check():
        row = {"step": step, "seconds": round(time.time() - t0, 1)}
        for key, hd in heads.items():
            k = key[1]
            ok = vTG[:, k - 1] >= 0
            top1 = predict(hd, vH[ok], vNX[ok], topk=1)[:, 0]
            acc = float((top1 == vTG[ok, k - 1]).float().mean())
            row[f"{key[0]}_k{k}"] = round(acc, 4)
            if acc > best[key][0]:
                best[key] = (acc, {n: p.detach().clone() for n, p in hd.state_dict().items()}, step)
        log.append(row); print(row, flush=True)

    val_check()
    next_eval = TRAIN_SECONDS / 6
    while True:
        el = time.time() - t0
        if el > TRAIN_SECONDS:
            break
        lr = LR * min(1.0, (step + 1) / 50) * max(0.02, 1 - el / TRAIN_SECONDS)
        for g in opt.param_groups:
            g["lr"] = lr
        pick = torch.randint(0, len(H), (BATCH,), generator=gen)
        h, nx, tg = H[pick], NX[pick], TG[pick]
        loss = 0.0
        for (v, k), hd in heads.items():
            ok = tg[:, k - 1] >= 0
            if ok.any():
                loss = loss + F.cross_entropy(hd(h[ok], nx[ok]), tg[ok, k - 1])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if time.time() - t0 > next_eval:
            val_check(); next_eval += TRAIN_SECONDS / 6
    val_check()
    train_seconds = time.time() - t0
    for key, hd in heads.items():
        hd.load_state_dict(best[key][1])

    # ---------------- held-out evaluation
    held = data["held"]
    d1 = load_draft_component(MD + "/draft_heads/residual_mlp_d1", model)
    groups = {"all": lambda s: True, "arithmetic": lambda s: s[3] == 0,
              "text": lambda s: s[3] == 1, "eval32_all": lambda s: s[4]}
    hH, hNX, hTG, hKD, hSID = flatten(held)
    preds = {key: predict(hd, hH, hNX) for key, hd in heads.items()}
    result = {"sizes": sizes, "train": {"steps": step, "batch_positions": BATCH, "inner": INNER,
              "lr": LR, "seconds": round(train_seconds, 1), "best_step": {f"{v}_k{k}": b[2]
              for (v, k), b in best.items()}, "val_log": log},
              "gen": {"seconds": round(data["gen_seconds"], 1),
                      "eval32_identical_to_generate_plain": data["eval32_identical"]},
              "heldout": {}}
    # per-sequence match lists
    seq_rows = {}
    for s in range(len(held)):
        rows = (hSID == s).nonzero()[:, 0]
        y, L = held[s][0], len(held[s][0])
        per = {}
        for v in ("h", "h+emb"):
            ms = []
            for i in range(L):
                r = rows[i]
                ms.append([bool(preds[(v, k)][r, 0] == y[i + k]) for k in range(1, KMAX + 1)
                           if i + k < L])
            per[v] = ms
        # sequential d=1: draft y[i+j] from h1 of position of y[i+j-1] (index i+j-1 into h1)
        h1 = held[s][2]
        if L > 1:
            with torch.no_grad():
                m1 = (d1(h1).argmax(-1) == y[1:]).tolist()
        else:
            m1 = []
        per["seq_d1"] = [[m1[i + j - 1] for j in range(1, KMAX + 1) if i + j < L] for i in range(L)]
        per["m1"] = m1
        seq_rows[s] = per
    for gname, fn in groups.items():
        ids = [s for s in range(len(held)) if fn(held[s])]
        sel = torch.tensor([bool(fn(held[int(s)])) for s in hSID])
        g = {"sequences": len(ids), "rollout_tokens": int(sum(len(held[s][0]) for s in ids)),
             "mean_rollout_len": round(sum(len(held[s][0]) for s in ids) / max(len(ids), 1), 2)}
        for v in ("h", "h+emb"):
            acc = {}
            for k in range(1, KMAX + 1):
                ok = sel & (hTG[:, k - 1] >= 0)
                p, t = preds[(v, k)][ok], hTG[ok, k - 1]
                acc[f"k{k}_top1"] = round(float((p[:, 0] == t).float().mean()), 4)
                acc[f"k{k}_top3"] = round(float((p == t[:, None]).any(-1).float().mean()), 4)
                acc[f"k{k}_n"] = int(ok.sum())
            g[f"medusa_{v}"] = {"acc": acc, "tau": {f"K{K}": {a: round(b, 3) for a, b in
                                tau_stats([seq_rows[s][v] for s in ids], K).items()}
                                for K in range(1, KMAX + 1)}}
        m1 = [x for s in ids for x in seq_rows[s]["m1"]]
        g["seq_d1_shipped"] = {"agree_next_token": round(sum(m1) / max(len(m1), 1), 4),
                               "tau": {f"K{K}": {a: round(b, 3) for a, b in
                                       tau_stats([seq_rows[s]["seq_d1"] for s in ids], K).items()}
                                       for K in range(1, KMAX + 1)}}
        result["heldout"][gname] = g
    (OUT / "result.json").write_text(json.dumps(result, indent=1))
    for gname, g in result["heldout"].items():
        print(gname, g["sequences"], g["mean_rollout_len"])
        for v in ("medusa_h", "medusa_h+emb", "seq_d1_shipped"):
            print("  ", v, g[v].get("acc", g[v].get("agree_next_token")),
                  {K: (x["tau_posmean"], x["tau_walk"]) for K, x in g[v]["tau"].items()})


if __name__ == "__main__" and sys.argv[1] == "train":
    train()
