"""Loop-aware speculative decoding on the embedded model, CPU: train the draft components, then
measure tau, acceptance, speed vs target-only decoding (full depth, rltlab.model.generate) and vs
the untrained shallow drafters (d=1, d=2) in the same run, at T=0 (identical-output check on every
prompt) and T=1, concurrency 1 (one prompt at a time) and 8 (one batch of 8).

    python -m rltlab.draft_heads.evaluate --out runs/loop_speculation
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from rltlab.draft_heads.heads import build_component, component_kwargs, save_component
from rltlab.draft_heads.train import distill, evaluate as agreement, training_rows
from rltlab.model.speculative import speculative_generate
from rltlab.model.generate import generate_plain

EOS = 0


def eval_prompts(tokenizer, model_dir, n: int, text_tokens: int = 24) -> list[list[int]]:
    """n - n // 2 held-out arithmetic questions + n // 2 held-out text openings ([EOT] +
    tokens); n >= 1 (one prompt: an arithmetic question)."""
    from rltlab.eval.problems import encode, eval_problems, heldout_text_rows
    if n < 1:
        raise ValueError(f"eval_prompts: n must be >= 1, got {n}")
    arith = [[EOS] + encode(tokenizer, p["question"])
             for p in eval_problems(model_dir, n - n // 2)]
    text = heldout_text_rows(tokenizer, model_dir, text_tokens, n // 2).tolist() if n // 2 \
        else []
    return arith + text


def eval_prompt_kinds(n: int) -> list[str]:
    """The workload of each of eval_prompts(..., n)."""
    return ["arithmetic"] * (n - n // 2) + ["text"] * (n // 2)


def train_components(model, tokenizer, args, out: Path, log=print) -> tuple[dict, dict]:
    rows = training_rows(tokenizer, args.train_rows, args.seq_len, seed=0)
    held = training_rows(tokenizer, 32, args.seq_len, seed=1)
    quality = {f"shallow d={d}": agreement(model, None, held, draft_rounds=d) for d in (1, 2)}
    components, logs = {}, {}
    for kind, steps, lr in (("residual_mlp", args.train_steps, 1e-3),
                            ("lora_lm_head", args.train_steps, 1e-3),
                            ("layer_lora", args.layer_lora_steps, 5e-4)):
        if steps <= 0:
            continue
        comp = build_component(kind, model, draft_rounds=1)
        started = time.perf_counter()
        logs[kind] = distill(model, comp, rows, steps=steps, batch_size=16, lr=lr,
                             log_every=max(1, steps // 4), heldout=held)
        save_component(comp, model, out / "components" / kind, {"train_log": logs[kind]})
        quality[f"{kind} d=1"] = agreement(model, comp, held)
        log(f"trained {kind}: {time.perf_counter() - started:.0f} s, held-out "
            f"{ {k: round(v, 4) for k, v in quality[f'{kind} d=1'].items()} }")
        components[f"{kind} d=1"] = comp.eval()
    return components, {"agreement": quality, "train_logs": logs}


def _timed(fn, repeats):
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return result, min(times)


def measure(model, prompts, configs, *, temperature, concurrency, k, max_tokens, repeats):
    """One row per config: tokens, seconds, tok/s, tau, acceptance, identical-to-target."""
    groups = [prompts[i: i + concurrency] for i in range(0, len(prompts), concurrency)]
    R = model.config.num_rounds

    def target():
        return [t for g in groups for t in generate_plain(
            model, g, max_tokens, depth=R, temperature=temperature, eos_token_id=EOS,
            seed=17).token_ids]
    ref, secs = _timed(target, repeats)
    n_tok = sum(map(len, ref))
    rows = [{"config": "target only (R=4)", "tokens": n_tok, "seconds": secs,
             "tok_s": n_tok / secs, "tau": 1.0, "acceptance": None,
             "identical": True if temperature == 0 else None}]
    for name, kwargs in configs.items():
        def spec():
            return [speculative_generate(model, g, max_tokens, k=k, temperature=temperature,
                                         seed=17, eos_token_id=EOS, **kwargs) for g in groups]
        outs, secs = _timed(spec, repeats)
        toks = [t for o in outs for t in o.token_ids]
        steps = sum(o.totals().steps for o in outs)
        emitted = sum(o.totals().emitted for o in outs)
        drafted = sum(o.totals().drafted for o in outs)
        accepted = sum(o.totals().accepted for o in outs)
        passes = sum(o.round_passes for o in outs)
        rows.append({"config": name, "tokens": sum(map(len, toks)), "seconds": secs,
                     "tok_s": sum(map(len, toks)) / secs, "tau": emitted / max(1, steps),
                     "acceptance": accepted / max(1, drafted),
                     "round_passes_per_token": passes / max(1, sum(map(len, toks))),
                     "identical": toks == ref if temperature == 0 else None,
                     "identical_prompts": sum(a == b for a, b in zip(toks, ref))})
    base = rows[0]["tok_s"]
    shallow = {r["config"]: r["tok_s"] for r in rows if r["config"].startswith("shallow")}
    for row in rows:
        row["speedup_vs_target"] = row["tok_s"] / base
        for name, tps in shallow.items():
            row[f"speedup_vs_{name.replace(' ', '_')}"] = row["tok_s"] / tps
    return rows


def tau_sweep(model, prompts, n_arith: int, ks, ds=(1, 2), max_tokens: int = 32) -> list[dict]:
    """Greedy tau / acceptance of the untrained shallow drafters per prompt type and (d, K),
    with the memory-bound cost model R*tau / ((K+1)*d + R-d)."""
    R, rows = model.config.num_rounds, []
    for d in ds:
        for k in ks:
            for kind, group in (("arithmetic", prompts[:n_arith]), ("text", prompts[n_arith:])):
                tot = speculative_generate(model, group, max_tokens, k=k, draft_rounds=d,
                                           eos_token_id=EOS).totals()
                rows.append({"d": d, "k": k, "prompts": kind, "tau": tot.tau,
                             "acceptance": tot.acceptance_rate,
                             "modelled_speedup": R * tot.tau / ((k + 1) * d + R - d)})
    return rows


def drafter_tau(model, prompts, n_arith: int, configs: dict, *, k: int, temperatures,
                max_tokens: int = 32, batch: int = 8) -> list[dict]:
    """tau / acceptance per drafter (speculative_generate kwargs), prompt type and temperature,
    prompts in batches of `batch` (tau does not depend on batching at T=0)."""
    rows = []
    for temperature in temperatures:
        for name, kwargs in configs.items():
            every = []
            for kind, group in (("arithmetic", prompts[:n_arith]), ("text", prompts[n_arith:]),
                                ("all", None)):
                tots = every if group is None else [
                    speculative_generate(model, group[i: i + batch], max_tokens, k=k,
                                         temperature=temperature, seed=17 + i,
                                         eos_token_id=EOS, **kwargs).totals()
                    for i in range(0, len(group), batch)]
                every = every + tots if group is not None else every
                steps, drafted = sum(t.steps for t in tots), sum(t.drafted for t in tots)
                rows.append({"T": temperature, "drafter": name, "prompts": kind,
                             "n": len(group or prompts), "tau": sum(t.emitted for t in tots)
                             / max(1, steps),
                             "acceptance": sum(t.accepted for t in tots) / max(1, drafted)})
    return rows


@torch.no_grad()
def text_agreement(model, tokenizer, model_dir, components: dict, n: int = 128,
                   max_tokens: int = 32) -> list[dict]:
    """Teacher-forced top-1 agreement with round R on held-out eval text vs training-split text
    (n openings of 24 tokens each plus their greedy full-depth continuation), at prompt and at
    continuation positions, for the shallow drafters and `components` (name -> component):
    shows how much easier the model's own pretraining text is for shallow drafting."""
    from rltlab.eval.problems import heldout_text_rows
    from rltlab.draft_heads.rollout_data import rollouts, sequence_features, training_prompts
    sets = {"held-out eval text": heldout_text_rows(tokenizer, model_dir, 24, n).tolist(),
            "training-split text": [p for p, _ in training_prompts(tokenizer, 0, n, 24, seed=99)]}
    drafters = {f"shallow d={d}": (d, model.lm_head) for d in (1, 2)}
    drafters.update({k: (c.draft_rounds, c) for k, c in components.items()})
    rows = []
    for name, prompts in sets.items():
        seqs = rollouts(model, [(p, 0) for p in prompts], max_tokens=max_tokens,
                        temperatures=(0.0,), eos_token_id=EOS, progress=False)
        feats = sequence_features(model, seqs, (1, 2), progress=False)
        target = model.lm_head(feats.final).argmax(-1)
        position = torch.arange(feats.mask.shape[1])
        # position t predicts token t+1: prompt positions predict prompt tokens
        prompt_len = torch.tensor([len(prompts[i]) for _, _, i in seqs])[:, None]
        at_prompt = position < prompt_len - 1
        at_cont = ~at_prompt & (position < feats.mask.sum(1, keepdim=True) - 1)
        for drafter, (d, head) in drafters.items():
            ok = head(feats.hidden[d]).argmax(-1) == target
            rows.append({"text": name, "n": len(prompts), "drafter": drafter,
                         "prompt_agree": float(ok[at_prompt].float().mean()),
                         "continuation_agree": float(ok[at_cont].float().mean())})
    return rows


def extra_memory(model, components, k, max_tokens, prompt_len, batch) -> dict:
    cfg, item = model.config, next(model.parameters()).element_size()
    per_col = 2 * cfg.num_rounds * cfg.num_hidden_layers * cfg.num_key_value_heads \
        * cfg.head_dim * item * batch
    plain_cols, spec_cols = prompt_len + max_tokens, prompt_len + (max_tokens + 1) * (k + 1)
    return {"adapter_bytes": {n: sum(p.numel() * p.element_size()
                                     for p in c.adapter_parameters())
                              for n, c in components.items()},
            "kv_bytes_plain": per_col * plain_cols, "kv_bytes_spec_worst": per_col * spec_cols,
            "note": "KV: contiguous LoopedKVCache, rejected columns kept masked (worst case "
                    "K+1 columns per emitted token); actual columns used are much fewer"}


def table(rows, keys) -> str:
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        cells = [f"{r[k]:.3g}" if isinstance(r.get(k), float) else str(r.get(k, ""))
                 for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _load_named(paths, model, model_dir) -> dict:
    """name -> loaded component, for these paths (none given: the shipped components)."""
    from rltlab.draft_heads.selfdistill import shipped_components
    from rltlab.engine_patches.loop_draft import load_draft_component
    named = {}
    for path in paths or shipped_components(model_dir):
        comp = load_draft_component(path, model)
        name = f"trained d={comp.draft_rounds} ({Path(path).name})"
        if name in named:   # same directory name elsewhere: name it by its full path
            name = f"trained d={comp.draft_rounds} ({path})"
        named[name] = comp
    return named


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model dir (default: the embedded model)")
    p.add_argument("--out", default="runs/loop_speculation")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--train-rows", type=int, default=192)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--train-steps", type=int, default=150)
    p.add_argument("--layer-lora-steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--k-sweep", type=int, nargs="*", default=[],
                   help="also: greedy tau of the shallow drafters per prompt type for these K")
    p.add_argument("--only-sweep", action="store_true", help="no training / speed runs")
    p.add_argument("--agreement-drafters", nargs="*", default=None, metavar="PATH",
                   help="only: teacher-forced agreement of shallow d=1, d=2 and these components "
                   "(default: the shipped ones) on held-out vs training-split text")
    p.add_argument("--tau-drafters", nargs="*", default=None, metavar="PATH",
                   help="only: tau of shallow d=1, d=2 and these components (default: the "
                   "shipped ones) on --prompts held-out prompts, K=--k, each --temperatures")
    args = p.parse_args(argv)
    from rltlab.model.checkpoint import load_model
    torch.manual_seed(0)
    model, tokenizer, model_dir = load_model(args.model, threads=args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = eval_prompts(tokenizer, model_dir, args.prompts)
    if args.agreement_drafters is not None:
        comps = _load_named(args.agreement_drafters, model, model_dir)
        rows = text_agreement(model, tokenizer, model_dir, comps, n=args.prompts)
        print(table(rows, ["text", "n", "drafter", "prompt_agree", "continuation_agree"]))
        (out / "text_agreement.json").write_text(json.dumps(rows, indent=2))
        return {"text_agreement": rows}
    if args.tau_drafters is not None:
        configs = {"shallow d=1": {"draft_rounds": 1}, "shallow d=2": {"draft_rounds": 2}}
        configs.update({name: component_kwargs(comp) for name, comp in
                        _load_named(args.tau_drafters, model, model_dir).items()})
        rows = drafter_tau(model, prompts, args.prompts - args.prompts // 2, configs, k=args.k,
                           temperatures=args.temperatures, max_tokens=args.max_tokens)
        print(table(rows, ["T", "drafter", "prompts", "n", "tau", "acceptance"]))
        (out / "drafter_tau.json").write_text(json.dumps(rows, indent=2))
        return {"drafter_tau": rows}
    if args.k_sweep:
        sweep = tau_sweep(model, prompts, args.prompts - args.prompts // 2, args.k_sweep,
                          max_tokens=args.max_tokens)
        print(table(sweep, ["d", "k", "prompts", "tau", "acceptance", "modelled_speedup"]))
        (out / "tau_sweep.json").write_text(json.dumps(sweep, indent=2))
        if args.only_sweep:
            return {"tau_sweep": sweep}
    components, training = train_components(model, tokenizer, args, out)
    configs = {"shallow d=1": {"draft_rounds": 1}, "shallow d=2": {"draft_rounds": 2}}
    configs.update({name: component_kwargs(c) for name, c in components.items()})
    generate_plain(model, prompts[:2], 4, depth=model.config.num_rounds)          # warm-up
    results = {"args": vars(args), "model_dir": str(model_dir), "training": training,
               "memory": extra_memory(model, components, args.k, args.max_tokens,
                                      max(map(len, prompts)), max(args.concurrency)),
               "runs": []}
    for temperature in args.temperatures:
        for conc in args.concurrency:
            rows = measure(model, prompts, configs, temperature=temperature, concurrency=conc,
                           k=args.k, max_tokens=args.max_tokens, repeats=args.repeats)
            results["runs"].append({"temperature": temperature, "concurrency": conc,
                                    "rows": rows})
            print(f"\nT={temperature} concurrency={conc}")
            print(table(rows, ["config", "tokens", "tok_s", "tau", "acceptance",
                               "speedup_vs_target", "speedup_vs_shallow_d=1",
                               "round_passes_per_token", "identical"]))
            (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    agree = training["agreement"]
    print("\nheld-out teacher-forced agreement with round R (d=1 unless named)")
    print(table([{"drafter": k, **v} for k, v in agree.items()],
                ["drafter", "agree", "accept_t1", "acc@1", "acc@2", "acc@3", "acc@4"]))
    print(f"\nresults: {out / 'results.json'}; median tau "
          f"{statistics.median(r['tau'] for run in results['runs'] for r in run['rows']):.2f}")
    return results


if __name__ == "__main__":
    from rltlab.common.command import run_command

    run_command(main)
