"""Evaluate exit policies in REAL generation (rollout engine, LAST_EXITED) on held-out
arithmetic, plus teacher-forced text perplexity and engine throughput on the model's device.

    python -m rltlab.exit_predictor.evaluate --predictor DIR/n1 [--predictor-k1 DIR/n1]
        --out DIR [--problems 100] [--figures docs/experiments/figures]

Policies: fixed depth 1-4, stock Q-exit (threshold sweep, min_loops 1), the delayed stock
gate, the hidden-state-delta rule (exit after r >= 2 when ||h_r - h_{r-1}|| / ||h_{r-1}|| <=
eps), the successive-KL rule (exit after r >= 2 when KL(p_r || p_{r-1}) <= eps, nats), the
oracle (every round computed; the token exits at the earliest round whose argmax equals round
R's: its depth is counted as that round, although R rounds were computed to find it) and the
N+k lookahead predictor (threshold sweep). Quality = exact match (%), paired difference vs
fixed depth R with its standard error; depth = mean executed rounds per decode token, first
output token excluded.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, Sequence


from rltlab.exit_predictor.baselines import oracle_generate, register_rule_policies
from rltlab.exit_predictor.report import acceptance, markdown_tables
from rltlab.exit_predictor.text_eval import text_table

# ----------------------------------------------------------------------------- settings

def _params(policy: str, max_tokens: int, args: dict[str, Any] | None = None,
            threshold: float | None = None, eos: int | None = 0):
    from rltlab.engine import SamplingParams

    kw: dict[str, Any] = {"temperature": 0.0, "max_tokens": max_tokens, "seed": 0,
                          "min_loops": 1, "exit_policy": policy,
                          "exit_policy_args": dict(args or {}),
                          "stop_token_ids": [eos] if eos is not None else []}
    if threshold is not None:
        kw["exit_threshold"] = float(threshold)
    return SamplingParams(**kw)


def default_settings(R: int, lookahead: dict[str, dict[str, Any]], *,
                     depths: Sequence[int] | None = None,
                     q_thresholds: Sequence[float] = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99),
                     delayed_thresholds: Sequence[float] = (0.5, 0.7, 0.9, 0.95),
                     delta_eps: Sequence[float] = (0.2, 0.3, 0.4, 0.5, 0.6),
                     kl_eps: Sequence[float] = (1e-4, 1e-3, 0.01, 0.1, 0.5),
                     lookahead_thresholds: Sequence[float] | dict[str, Sequence[float]] = (
                         0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99),
                     oracle_min_rounds: Sequence[int] = (),
                     select_only_thresholds: Sequence[float] = (),
                     lookahead_args: dict[str, dict[str, Any]] | None = None
                     ) -> list[dict[str, Any]]:
    """(policy label, setting, engine policy name, exit_policy_args, Q threshold) rows.
    lookahead: label -> {"name": registered policy, "threshold": calibrated threshold};
    lookahead_thresholds: one list for all, or label -> list. oracle_min_rounds: the floored
    oracle ("oracle_floor": exit at max(m, the oracle's round)) for each m.
    select_only_thresholds: Q-exit under EngineConfig.exit_semantics="select_only" (policy
    "select_only": every token runs all R rounds, the output comes from the exit round).
    lookahead_args: label -> extra exit_policy_args of all its settings (e.g. a chained
    predictor's {"then_threshold": 0.9})."""
    rows = [{"policy": "fixed", "setting": f"depth={d}", "name": "fixed",
             "args": {"depth": d}, "threshold": None}
            for d in (depths if depths is not None else range(1, R + 1))]
    rows += [{"policy": "q_exit", "setting": f"t={t:g}", "name": "q_exit", "args": {},
              "threshold": t} for t in q_thresholds]
    rows += [{"policy": "q_exit_delayed", "setting": f"t={t:g}", "name": "q_exit_delayed",
              "args": {}, "threshold": t} for t in delayed_thresholds]
    rows += [{"policy": "hidden_delta", "setting": f"eps={e:g}", "name": "hidden_delta",
              "args": {"eps": e}, "threshold": None} for e in delta_eps]
    rows += [{"policy": "successive_kl", "setting": f"eps={e:g}", "name": "successive_kl",
              "args": {"eps": e}, "threshold": None} for e in kl_eps]
    rows += [{"policy": "select_only", "setting": f"t={t:g}", "name": "q_exit", "args": {},
              "threshold": t, "select_only": True} for t in select_only_thresholds]
    rows.append({"policy": "oracle", "setting": "oracle", "name": None, "args": {},
                 "threshold": None})
    rows += [{"policy": "oracle_floor", "setting": f"min={m}", "name": None,
              "args": {"min_round": m}, "threshold": None} for m in oracle_min_rounds]
    for label, spec in lookahead.items():
        extra = lookahead_thresholds.get(label, ()) if isinstance(lookahead_thresholds, dict) \
            else lookahead_thresholds
        thrs = sorted(set(extra) | {round(float(spec["threshold"]), 4)})
        extra_args = (lookahead_args or {}).get(label, {})
        rows += [{"policy": label, "setting": f"p>={t:g}", "name": spec["name"],
                  "args": {**extra_args, "threshold": t}, "threshold": None,
                  "calibrated": abs(t - round(float(spec["threshold"]), 4)) < 1e-9}
                 for t in thrs]
    return rows


def evaluate_arithmetic_settings(model, tokenizer, llm, problems: Sequence[dict],
                                 settings: Sequence[dict[str, Any]], *, max_tokens: int = 40,
                                 progress: bool = False, select_llm=None,
                                 executed: dict[str, list] | None = None
                                 ) -> tuple[list[dict], dict[str, list]]:
    """Real-generation exact match and depth per setting; returns (rows, per-problem scores).
    Settings marked "select_only" run on `select_llm` (an engine built with
    exit_semantics="select_only"). `executed`, if given, receives each setting's per-problem
    executed rounds per output token (key -> list of lists, first output token included)."""
    from rltlab.eval.tasks import as_gen_output, engine_generate_fn, evaluate_arithmetic

    R = model.config.num_rounds
    rows, scores = [], {}
    it = settings
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(settings, desc="policies", unit="setting")
    for s in it:
        start = time.perf_counter()
        if s["policy"] in ("oracle", "oracle_floor"):
            gen = lambda prompts, m=s["args"].get("min_round", 1): oracle_generate(  # noqa
                model, prompts, max_tokens, min_round=m)
        else:
            if s.get("select_only") and select_llm is None:
                raise ValueError(f"setting {s['policy']} {s['setting']} needs select_llm (an "
                                 "engine with exit_semantics='select_only')")
            gen = engine_generate_fn(select_llm if s.get("select_only") else llm,
                                     _params(s["name"], max_tokens, s["args"], s["threshold"]))
        outs: list = []
        res = evaluate_arithmetic(lambda prompts, g=gen: _keep(g(prompts), outs, as_gen_output),
                                  tokenizer, problems, num_rounds=R)
        key = f"{s['policy']} {s['setting']}"
        scores[key] = res["scores"]
        if executed is not None:
            executed[key] = [list(o.executed_depths or o.exit_depths) for o in outs]
        rows.append({"policy": s["policy"], "setting": s["setting"],
                     "quality": 100 * res["exact_match"],
                     "quality_se": 100 * res["exact_match_se"],
                     "mean_rounds": res.get("mean_executed", math.nan),
                     "mean_selected": res.get("mean_selected", math.nan),
                     "decode_tokens": res.get("decode_tokens", 0),
                     "executed_hist": res.get("executed_hist", {}),
                     "calibrated": bool(s.get("calibrated", False)),
                     "seconds": round(time.perf_counter() - start, 2), "key": key})
    return rows, scores


def _keep(outputs: list, sink: list, normalize) -> list:
    """Append the normalized outputs to sink (in order) and return them."""
    outputs = [normalize(o) for o in outputs]
    sink.extend(outputs)
    return outputs


def add_paired(rows: list[dict], scores: dict[str, list], reference: str) -> list[dict]:
    from rltlab.eval.metrics import paired_difference

    for row in rows:
        d = paired_difference(scores[row["key"]], scores[reference])
        row["diff_pp"], row["diff_se_pp"] = 100 * d.diff, 100 * d.se
        row["wins"], row["losses"] = d.a_only, d.b_only
    return rows


# ----------------------------------------------------------------------------- throughput

def throughput(model, prompts: Sequence[Sequence[int]], policies: dict[str, dict[str, Any]],
               *, concurrency: Sequence[int] = (1, 64), max_tokens: int = 32,
               requests_per_slot: int = 2, min_requests: int = 4) -> list[dict[str, Any]]:
    """Closed-loop engine throughput per policy and concurrency C on the model's device:
    max(min_requests, requests_per_slot * C) requests of max_tokens tokens (ignore_eos),
    max_num_seqs = C (an engine sized for them: rltlab.eval.engines, released after), the
    whole batch once untimed first (CUDA graphs are captured on first use); tokens/s, median
    TTFT/TPOT (ms), mean executed rounds. Same run for every policy (interleaved per C)."""
    from rltlab.engine.outputs import raise_on_errors
    from rltlab.eval.engines import release_memory, sized_llm
    from rltlab.eval.metrics import depth_stats, timing_records, timing_stats

    out = []
    device = next(model.parameters()).device
    longest = max(len(p) for p in prompts)
    for c in concurrency:
        llm = sized_llm(model, max_num_seqs=c, max_len=longest + max_tokens)
        n = max(min_requests, requests_per_slot * c)
        batch = [list(prompts[i % len(prompts)]) for i in range(n)]
        for label, spec in policies.items():
            params = _params(spec["name"], max_tokens, spec.get("args"), spec.get("threshold"),
                             eos=None)
            params = dataclasses.replace(params, ignore_eos=True)
            llm.generate(batch, params)           # warm-up
            _sync(device)
            t0 = time.perf_counter()
            outs = raise_on_errors(llm.generate(batch, params), f"policy {spec['name']}")
            _sync(device)
            wall = time.perf_counter() - t0
            st = timing_stats(timing_records(outs))
            d = depth_stats([o.outputs[0].exit_depths for o in outs],
                            [o.outputs[0].executed_depths for o in outs],
                            model.config.num_rounds)
            out.append({"policy": label, "concurrency": c, "requests": n,
                        "device": str(device),
                        "tokens_per_s": st["output_tokens"] / wall,
                        "ttft_ms": 1000 * st["ttft_median"], "tpot_ms": 1000 * st["tpot_median"],
                        "mean_rounds": d["mean_executed"]})
        del llm
        release_memory()
    for row in out:
        base = next(r for r in out if r["concurrency"] == row["concurrency"]
                    and r["policy"] == next(iter(policies)))
        row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"]
    return out


def _sync(device) -> None:
    import torch
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def run(model_dir: str | None, predictors: dict[str, str], out_dir: str | Path, *,
        problems: int = 100, max_tokens: int = 40, text_rows: int = 11,
        throughput_tokens: int = 32, concurrency: Sequence[int] = (1, 64),
        figures: str | Path | None = None, threads: int = 2,
        settings_kw: dict[str, Any] | None = None, progress: bool = True,
        requests_per_slot: int = 2, problem_offset: int = 0, model=None, tokenizer=None,
        device: str = "auto", dtype: str = "auto") -> dict[str, Any]:
    """The whole experiment; writes OUT/results.json and the plots (into `figures` or OUT).
    problem_offset k: problems k..k+problems-1 of the mixed held-out set (a fresh slice for
    a confirmatory run). model / tokenizer: an already loaded model (model_dir then names its
    checkpoint, for the eval files), else model_dir is loaded on `device` in `dtype` ("auto":
    CUDA in bfloat16 where there is one). Engines run where the model is, each sized for its
    batch (rltlab.eval.engines)."""
    from rltlab.eval import plots
    from rltlab.model.checkpoint import model_hash
    from rltlab.engine_patches.lookahead_exit import install, load_policy
    from rltlab.eval.engines import release_memory, sized_llm
    from rltlab.common.atomic import write_json_atomic
    from rltlab.common.environment import environment
    from rltlab.eval.plots import frame
    from rltlab.eval.problems import encode, eval_problems, heldout_text_rows
    from rltlab.model.checkpoint import load_model

    if problem_offset < 0:
        raise ValueError(f"problem_offset must be >= 0, got {problem_offset}")
    if problems < 1 or text_rows < 1:   # before minutes of generation, not after
        raise ValueError(f"problems and text_rows must be >= 1 (the arithmetic and the "
                         f"teacher-forced text parts), got {problems} and {text_rows}")
    t_start = time.perf_counter()
    if model is None:    # a bad one: no OUT yet
        model, tokenizer, mdir = load_model(model_dir, threads=threads, device=device,
                                            dtype=dtype)
    else:
        if tokenizer is None:
            raise ValueError("run(model=...) needs its tokenizer too")
        mdir = model_dir
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    R = model.config.num_rounds
    mhash = model_hash(model)
    register_rule_policies(model)
    lookahead = {}
    for label, spec in predictors.items():
        name = label.replace(" ", "_")
        path, _, then = spec.partition("+")    # "DIR0+DIR1": round-0 predictor, then N = 1
        install(model, path, name=name, model_hash=mhash, then=then or None)
        policy = load_policy(path, model, name=name, model_hash=mhash)
        lookahead[label] = {"name": name, "threshold": policy.threshold, "policy": policy,
                            "checkpoint": str(path), "manifest": policy.manifest}
    settings = default_settings(R, lookahead, **(settings_kw or {}))
    probs = eval_problems(mdir, problem_offset + problems)[problem_offset:]
    seqs = min(128, max(1, len(probs)))
    longest = max(1 + len(encode(tokenizer, p["question"])) for p in probs) + max_tokens
    llm = sized_llm(model, tokenizer, max_num_seqs=seqs, max_len=longest)
    select_llm = (sized_llm(model, tokenizer, max_num_seqs=seqs, max_len=longest,
                            exit_semantics="select_only")
                  if any(s.get("select_only") for s in settings) else None)
    executed: dict[str, list] = {}
    rows, scores = evaluate_arithmetic_settings(model, tokenizer, llm, probs, settings,
                                                max_tokens=max_tokens, progress=progress,
                                                select_llm=select_llm, executed=executed)
    del llm, select_llm
    release_memory()     # the throughput engines below get the memory back
    ref = f"fixed depth={R}"
    add_paired(rows, scores, ref)
    text_rows_t = heldout_text_rows(tokenizer, mdir, 512, text_rows)
    text = text_table(model, text_rows_t, lookahead, settings)
    figdir = Path(figures) if figures else out
    paths = plots.plot_quality_vs_depth(
        frame(rows), figdir, label="setting", yerr="quality_se",
        quality_label="held-out arithmetic exact match (%)",
        title=f"Real generation (LAST_EXITED), {len(probs)} held-out problems",
        stem="n_plus_2_quality_vs_depth")
    text_df = frame(text)
    text_df["neg_loss"] = -text_df["loss"]
    paths += plots.plot_quality_vs_depth(
        text_df, figdir, y="neg_loss", label="setting",
        quality_label="- held-out text loss (nats/token, higher is better)",
        title="Teacher-forced text (LAST_EXITED)", stem="n_plus_2_text_vs_depth")
    hist = {r["key"]: r["executed_hist"] for r in rows
            if r["setting"] in ("oracle", f"depth={R}") or r.get("calibrated")}
    paths += plots.plot_depth_histogram(hist, figdir, num_rounds=R,
                                        title="Executed rounds per decode token (arithmetic)",
                                        stem="n_plus_2_depth_hist")
    accept = {label: acceptance(rows, scores, label, R) for label in lookahead}
    tp = []
    if concurrency:
        pols = {f"fixed depth={R}": {"name": "fixed", "args": {"depth": R}},
                "fixed depth=2": {"name": "fixed", "args": {"depth": 2}}}
        for label, spec in lookahead.items():
            pols[f"{label} (calibrated thr)"] = {"name": spec["name"],
                                                 "args": {"threshold": spec["threshold"]}}
        prompts = [[0] + encode(tokenizer, p["question"]) for p in probs]
        tp = throughput(model, prompts, pols, concurrency=concurrency,
                        max_tokens=throughput_tokens, requests_per_slot=requests_per_slot)
    results = {"model_dir": str(mdir), "model_hash": mhash, "problems": len(probs),
               "problem_offset": problem_offset,
               "max_tokens": max_tokens, "reference": ref, "arithmetic": rows, "text": text,
               "problem_set": [{k: p[k] for k in ("kind", "hops", "answer") if k in p}
                               for p in probs],
               "scores": scores, "executed_rounds": executed,
               "throughput": tp, "acceptance": accept,
               "predictors": {k: {"checkpoint": v["checkpoint"], "threshold": v["threshold"],
                                  "temperature": v["manifest"]["temperature"],
                                  "decision_round": v["manifest"]["decision_round"],
                                  "exit_round": v["manifest"]["exit_round"],
                                  "label": v["manifest"]["label"],
                                  "test_metrics": v["manifest"].get("metrics", {}).get("test")}
                              for k, v in lookahead.items()},
               "plots": [str(p) for p in paths], "environment": environment(),
               "seconds": round(time.perf_counter() - t_start, 1)}
    write_json_atomic(out / "results.json", results)
    return results


QUICK = {"q_thresholds": (0.3, 0.5, 0.7, 0.9), "delayed_thresholds": (0.5, 0.9),
         "delta_eps": (0.3, 0.5, 0.6), "kl_eps": (1e-3, 0.01, 0.1),
         "lookahead_thresholds": (0.9, 0.95, 0.99)}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m rltlab.exit_predictor.evaluate")
    ap.add_argument("--predictor", action="append", default=[],
                    help="LABEL=CHECKPOINT_DIR (repeatable), e.g. n_plus_2=runs/p/n1; "
                    "LABEL=N0_DIR+N1_DIR: a round-0 predictor, then an N = 1 one")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--problems", type=int, default=100)
    ap.add_argument("--problem-offset", type=int, default=0,
                    help="skip this many problems of the mixed held-out set first")
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--text-rows", type=int, default=11)
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 64])
    ap.add_argument("--throughput-tokens", type=int, default=32)
    ap.add_argument("--figures", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests-per-slot", type=int, default=2,
                    help="throughput: requests = this x C (at least 4)")
    ap.add_argument("--sweeps", default=None,
                    help='JSON of default_settings keywords, e.g. {"q_thresholds": [0.5]}')
    ap.add_argument("--quick", action="store_true",
                    help="shorter sweeps (Q-exit 4, delayed 2, rules 3 each, predictor 3 + "
                         "its calibrated threshold)")
    args = ap.parse_args(argv)
    preds = dict(p.split("=", 1) for p in args.predictor)
    res = run(args.model_dir, preds, args.out, problems=args.problems,
              max_tokens=args.max_tokens, text_rows=args.text_rows,
              concurrency=args.concurrency, throughput_tokens=args.throughput_tokens,
              figures=args.figures, threads=args.threads,
              settings_kw={**(QUICK if args.quick else {}),
                           **(json.loads(args.sweeps) if args.sweeps else {})},
              requests_per_slot=args.requests_per_slot, problem_offset=args.problem_offset)
    print(markdown_tables(res))
    for label, acc in res["acceptance"].items():
        print(label, acc)
    return res


if __name__ == "__main__":
    from rltlab.common.command import run_command

    run_command(main)
