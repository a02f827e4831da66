"""Library side of the workbench notebooks (01_collect_traces, 04_evaluate; the loop notebook
uses rltlab.loop). Notebooks stay thin: each cell calls one or two functions from here.

Conventions: the embedded arithmetic task (rltlab.data) with prompts [EOT] + encode(question),
greedy decoding, the rollout engine (rltlab.engine.LLM) in fp32 on the CPU unless told
otherwise. Depth figures exclude the first output token (REFERENCE section 4).
"""
from __future__ import annotations

import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from rltlab.runs import new_run_dir, write_json_atomic


# ----------------------------------------------------------------------------- setup

def ensure_run_dir(run_dir: str | os.PathLike | None, name: str) -> Path:
    """RUN_DIR as a Path; None (an interactive session, not `rltlab run`) creates a new one."""
    path = Path(run_dir) if run_dir else new_run_dir(name)
    path.mkdir(parents=True, exist_ok=True)
    return path


def load_model(model_dir: str | os.PathLike | None = None, dtype: str = "float32",
               device: str = "cpu", threads: int | None = None, hf_tokenizer: bool = False):
    """(model, tokenizer, model_dir): model_dir None = the embedded default (artifacts/ouro-tiny).

    The tokenizer is a `tokenizers.Tokenizer` read from tokenizer.json (no transformers
    import: notebooks start faster); hf_tokenizer=True gives the transformers fast tokenizer.
    Both work with rltlab.eval.tasks (ids without special tokens).
    """
    from rltlab.checkpoint import from_pretrained, load_tokenizer
    from rltlab.paths import embedded_model_dir

    if threads:
        torch.set_num_threads(threads)
    path = Path(model_dir) if model_dir else embedded_model_dir()
    if hf_tokenizer:
        tokenizer = load_tokenizer(path)
    else:
        from tokenizers import Tokenizer
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json")
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    return from_pretrained(path, dtype=dtype, device=device), tokenizer, path


def make_llm(model, tokenizer=None, **engine_kwargs):
    """An rltlab.engine.LLM over an already loaded model (EngineConfig keyword arguments)."""
    from rltlab.engine import LLM

    return LLM(model, tokenizer, **engine_kwargs)


def environment() -> dict[str, Any]:
    """Hardware/dtype facts to stamp into metrics.json."""
    return {"torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "cuda": torch.cuda.is_available(),
            "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "threads": torch.get_num_threads()}


def encode(tokenizer, text: str) -> list[int]:
    from rltlab.eval.tasks import _encode
    return _encode(tokenizer, text)


# ----------------------------------------------------------------------------- data

def eval_problems(model_dir: str | os.PathLike | None, n: int, seed: int = 1234
                  ) -> list[dict[str, Any]]:
    """Held-out arithmetic problems: <model_dir>/eval/arithmetic_heldout.jsonl when it exists
    (the checkpoint's own eval set), else make_arithmetic_problems(n, seed, "heldout")."""
    from rltlab.data import make_arithmetic_problems

    path = Path(model_dir) / "eval" / "arithmetic_heldout.jsonl" if model_dir else None
    if path is not None and path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if len(rows) >= n:
            return rows[:n]
    return [{"question": p.question, "answer_text": p.answer_text, "answer": p.answer}
            for p in make_arithmetic_problems(n, seed, "heldout")]


def rollout_prompts(tokenizer, n: int, seed: int) -> tuple[list[list[int]], list[dict]]:
    """Training-split arithmetic prompts ([EOT] + question) for rollouts, and their problems."""
    from rltlab.data import EOT_ID, make_arithmetic_problems

    problems = [{"question": p.question, "answer": p.answer}
                for p in make_arithmetic_problems(n, seed, "train")]
    return [[EOT_ID] + encode(tokenizer, p["question"]) for p in problems], problems


def heldout_text_rows(tokenizer, model_dir: str | os.PathLike | None, seq_len: int,
                      max_rows: int) -> torch.Tensor:
    """[N, seq_len] rows of [EOT] + held-out text (the checkpoint's eval/heldout_text.txt if
    present, else the held-out stdlib split)."""
    from rltlab.data import EOT_ID, load_text_corpus

    path = Path(model_dir) / "eval" / "heldout_text.txt" if model_dir else None
    text = path.read_text(encoding="utf-8") if path is not None and path.is_file() else \
        load_text_corpus(max_bytes=max(20_000, seq_len * max_rows * 8), split="heldout")
    ids = encode(tokenizer, text)
    body = seq_len - 1
    rows = [[EOT_ID] + ids[i:i + body] for i in range(0, len(ids) - body + 1, body)][:max_rows]
    if not rows:
        raise ValueError(f"held-out text too short for one row of {seq_len} tokens")
    return torch.tensor(rows, dtype=torch.long)


# ----------------------------------------------------------------------------- policies

def q_exit_params(threshold: float, max_tokens: int, *, min_loops: int = 1, seed: int = 0,
                  temperature: float = 0.0, eos_token_id: int | None = None):
    """SamplingParams of the stock Q-exit at `threshold` (1.0 = full depth)."""
    from rltlab.engine import SamplingParams

    return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed,
                          exit_threshold=float(threshold), min_loops=min_loops,
                          exit_policy="q_exit",
                          stop_token_ids=[eos_token_id] if eos_token_id is not None else [])


def fixed_params(depth: int, max_tokens: int, *, seed: int = 0, temperature: float = 0.0,
                 eos_token_id: int | None = None):
    from rltlab.engine import SamplingParams

    return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed,
                          min_loops=1, exit_policy="fixed", exit_policy_args={"depth": int(depth)},
                          stop_token_ids=[eos_token_id] if eos_token_id is not None else [])


def evaluate_policies(llm, tokenizer, problems: Sequence[dict], *, thresholds: Sequence[float] = (),
                      depths: Sequence[int] = (), max_tokens: int = 48, min_loops: int = 1,
                      batch_size: int | None = None, label: str | None = None,
                      model_dir: str | os.PathLike | None = None, wrap_generate=None
                      ) -> tuple[list[dict[str, Any]], dict[str, list[float]]]:
    """Arithmetic exact match vs mean executed rounds for fixed depths and Q-exit thresholds,
    generated by the engine (real generation, LAST_EXITED).

    Returns (rows, scores): one row per setting {policy, setting, threshold, depth, quality
    (exact match, %), quality_se (%), mean_rounds (executed), mean_selected, decode_tokens,
    weight_version, seconds}; scores maps the setting key to per-problem 0/1 scores (for paired
    differences). `label` prefixes the policy name (e.g. "v1 q_exit").
    With rltlab.scale.num_processes() > 1 (`rltlab run --num-processes N`) the evaluation runs
    on N ranks loading `model_dir` (rltlab.scale.delegate_evaluate). wrap_generate: applied to
    each generate_fn (the ranks' side: rltlab.distributed.sharded_generate_fn).
    """
    from rltlab import scale
    from rltlab.data import EOT_ID
    from rltlab.eval.tasks import engine_generate_fn, evaluate_arithmetic

    if scale.num_processes() > 1:
        return scale.delegate_evaluate(llm, problems, model_dir=model_dir, thresholds=thresholds,
                                       depths=depths, max_tokens=max_tokens,
                                       min_loops=min_loops, label=label)
    wrap_generate = wrap_generate or (lambda fn: fn)

    num_rounds = llm.llm_engine.num_rounds
    settings = [("fixed", f"depth={d}", fixed_params(d, max_tokens, eos_token_id=EOT_ID),
                 {"depth": d, "threshold": None}) for d in depths]
    settings += [("q_exit", f"t={t:g}", q_exit_params(t, max_tokens, min_loops=min_loops,
                                                      eos_token_id=EOT_ID),
                  {"depth": None, "threshold": float(t)}) for t in thresholds]
    rows, scores = [], {}
    version = llm.get_weight_version()
    for policy, setting, params, extra in settings:
        start = time.perf_counter()
        res = evaluate_arithmetic(wrap_generate(engine_generate_fn(llm, params)), tokenizer,
                                  problems, num_rounds=num_rounds, batch_size=batch_size)
        name = f"{label} {policy}" if label else policy
        key = f"{name} {setting}"
        scores[key] = res["scores"]
        rows.append({"policy": name, "setting": setting, **extra,
                     "quality": 100 * res["exact_match"], "quality_se": 100 * res["exact_match_se"],
                     "mean_rounds": res.get("mean_executed", math.nan),
                     "mean_selected": res.get("mean_selected", math.nan),
                     "decode_tokens": res.get("decode_tokens", 0), "weight_version": version,
                     "executed_hist": res.get("executed_hist", {}),
                     "seconds": round(time.perf_counter() - start, 3),
                     "tokens_per_s": res["output_tokens"] / max(time.perf_counter() - start, 1e-9),
                     "key": key})
    return rows, scores


def engine_gsm8k_fn(llm, tokenizer, max_tokens: int = 1024):
    """generate_fn for evaluate_gsm8k: greedy, the engine's default exit policy, up to
    max_tokens new tokens, stopped early once a gsm8k_cot stop string ("Q:", ...) appears."""
    from rltlab.engine import SamplingParams
    from rltlab.eval.gsm8k import GSM8K_STOP
    from rltlab.eval.tasks import engine_generate_fn

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=0)
    return engine_generate_fn(llm, params, stop=GSM8K_STOP, tokenizer=tokenizer)


def paired_table(scores: dict[str, list[float]], reference: str) -> list[dict[str, Any]]:
    """Paired difference (percentage points, with standard error) of every setting vs
    `reference` (a key of scores)."""
    from rltlab.eval.metrics import paired_difference

    out = []
    for key, values in scores.items():
        if key == reference:
            continue
        d = paired_difference(values, scores[reference])
        out.append({"setting": key, "vs": reference, "diff_pp": 100 * d.diff,
                    "se_pp": 100 * d.se, "n": d.n, "wins": d.a_only, "losses": d.b_only})
    return out


def text_perplexity_table(model, rows: torch.Tensor, thresholds: Sequence[float] = (),
                          min_loops: int = 1) -> list[dict[str, Any]]:
    """Teacher-forced held-out text loss (nats/token) and perplexity at fixed depth r = 1..R
    and for the Q-exit at each threshold (policy applied inside the forward, LAST_EXITED)."""
    from rltlab.eval.tasks import text_perplexity
    from rltlab.generate import make_exit_fn

    R = model.config.num_rounds
    res = text_perplexity(model, rows, per_round=True)
    table = [{"policy": "fixed", "setting": f"depth={r['round']}", "mean_rounds": float(r["round"]),
              "loss": r["loss"], "ppl": r["ppl"]} for r in res["rounds"]]
    for t in thresholds:
        fn = make_exit_fn(R, threshold=float(t), min_loops=min_loops)
        pol = text_perplexity(model, rows, exit_fn=fn)
        table.append({"policy": "q_exit", "setting": f"t={t:g}", "mean_rounds": pol["mean_rounds"],
                      "loss": pol["loss"], "ppl": pol["ppl"]})
    return table


# ----------------------------------------------------------------------------- traces

def collect_rollout_traces(llm, prompts: Sequence[Sequence[int]], out_dir: str | os.PathLike, *,
                           threshold: float, max_tokens: int, teacher: bool = True,
                           temperature: float = 0.0, seed: int = 0, min_loops: int = 1,
                           model_dir: str | os.PathLike | None = None,
                           **collector_kwargs) -> tuple[list, dict[str, Any]]:
    """Trace a rollout of `prompts` with the Q-exit at `threshold` (teacher mode by default).
    With rltlab.scale.num_processes() > 1 the collection runs on N ranks loading `model_dir`
    (rltlab.scale.delegate_collect; per-prompt seeds, merged manifest)."""
    from rltlab import scale
    from rltlab.data import EOT_ID
    from rltlab.traces import collect_traces

    if scale.num_processes() > 1:
        return scale.delegate_collect(llm, prompts, out_dir, model_dir=model_dir,
                                      threshold=threshold, max_tokens=max_tokens,
                                      teacher=teacher, temperature=temperature, seed=seed,
                                      min_loops=min_loops, **collector_kwargs)

    params = q_exit_params(threshold, max_tokens, min_loops=min_loops, seed=seed,
                           temperature=temperature, eos_token_id=EOT_ID)
    return collect_traces(llm, prompts, params, out_dir, teacher=teacher, **collector_kwargs)


def trace_summary(trace_dir: str | os.PathLike) -> dict[str, Any]:
    """Per-round means over traced tokens (executed rounds only): entropy (nats), top-1 prob,
    agreement of the round-r top-1 with the reference (round-R) token, KL(p_ref || p_r) (nats),
    CDF; plus the selected/executed depth histograms and calibration pairs (CDF_r vs agreement
    at r) for rounds below R."""
    from rltlab.traces import load_traces

    tr = load_traces(trace_dir, fields=["round_mask", "entropy", "top1_prob", "top1_id",
                                        "ref_token", "kl_ref", "cdf", "selected", "executed"])
    mask = tr["round_mask"]
    n, R = mask.shape
    agree = (tr["top1_id"] == tr["ref_token"][:, None]).float()
    per_round = []
    for r in range(R):
        m = mask[:, r]
        if not m.any():
            continue
        per_round.append({
            "round": r + 1, "tokens": int(m.sum()),
            "entropy": float(tr["entropy"][m, r].mean()),
            "top1_prob": float(tr["top1_prob"][m, r].mean()),
            "agree_with_ref": float(agree[m, r].mean()),
            "kl_ref": float(tr["kl_ref"][m, r].mean()), "cdf": float(tr["cdf"][m, r].mean())})
    hist = {k: {int(d): int((tr[k] == d).sum()) for d in range(1, R + 1)}
            for k in ("selected", "executed")}
    below = mask[:, :R - 1]
    calib = {"probs": tr["cdf"][:, :R - 1][below].tolist(),
             "labels": agree[:, :R - 1][below].tolist()}
    return {"tokens": n, "per_round": per_round, "hist": hist, "calibration": calib,
            "mean_selected": float(tr["selected"].float().mean()) if n else math.nan,
            "mean_executed": float(tr["executed"].float().mean()) if n else math.nan}


# ----------------------------------------------------------------------------- output

def save_metrics(run_dir: str | os.PathLike, metrics: dict[str, Any]) -> Path:
    """Write RUN_DIR/metrics.json atomically; adds the environment and a timestamp."""
    metrics = {**metrics, "environment": environment(),
               "written": time.strftime("%Y-%m-%dT%H:%M:%S")}
    return write_json_atomic(Path(run_dir) / "metrics.json", metrics)


def frame(rows: Sequence[dict[str, Any]], drop: Sequence[str] = ("executed_hist", "key")):
    """A pandas DataFrame of result rows for display (bulky columns dropped)."""
    import pandas as pd

    df = pd.DataFrame(list(rows))
    return df.drop(columns=[c for c in drop if c in df.columns])
