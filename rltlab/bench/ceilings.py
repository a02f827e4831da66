"""Physical ceilings of the engine benchmark's workloads, from rates measured in the same run.

    ceiling time = prefill FLOPs / matmul rate  +  decode bytes / copy bandwidth

* matmul rate: a large torch.matmul in the model's dtype (bf16 on the GPU), timed on the device;
* copy bandwidth: a large device-to-device copy, bytes read + written per second;
* prefill FLOPs, per prefilled prompt of P tokens (a group of n samples prefills once):
  R x (2 x linear weights of the shared layers x P  +  4 x layers x heads x head_dim x
  P(P+1)/2 causal (query, key) pairs)  +  2 x lm_head weights (the first token's logits);
* decode bytes, per decode position (output token i >= 1, produced at position P + i - 1 in
  e_i executed rounds): every round reads its own plane's K/V of the P + i positions it attends
  to (K + V, every layer), and the shared-layer weights once per round *step*, which up to
  `rows` sequences share (the workload's concurrency), plus the lm_head once per sampling step.

Both terms come from the run's own outputs (real lengths and executed depths), so EOS-ended
and early-exit workloads are counted as they ran. The two phases are added, not overlapped:
the ceiling is what an engine that runs prefill at the matmul rate and decode at the copy
bandwidth would reach. Decode FLOPs and the K/V writes are not counted (decode is
memory-bound; a position's writes are a 1/context fraction of its reads).

Depth pairs (a fixed-depth baseline and the same workload replaying cheaper exit depths):
ideal e2e time of the cheap run = prefill time + decode time x (its mean executed rounds /
the baseline's, R), with the prefill time from the baseline's prefill-only run (max_tokens 1)
and the decode time = the baseline's decode tokens / its decode-phase tok/s.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


# ------------------------------------------------------------------------ device rates
def device_seconds(fn, device, repeats: int, warmup: int = 2) -> float:
    """Seconds per call of fn, timed on the device (CUDA events around the calls; the host
    clock elsewhere)."""
    for _ in range(warmup):
        fn()
    if torch.device(device).type != "cuda":
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def matmul_tflop_s(device, dtype, size: int | None = None, repeats: int = 20) -> float:
    """TFLOP/s of a size^3 torch.matmul (8192 on CUDA, 256 elsewhere: CPU smoke runs; there
    the best of 5 timings, as a busy core once made the ceiling 50x too low and the figures
    above it thousands of percent)."""
    cuda = torch.device(device).type == "cuda"
    size = size or (8192 if cuda else 256)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=gen).to(dtype)
    b = torch.randn(size, size, device=device, generator=gen).to(dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    seconds = min(device_seconds(lambda: torch.matmul(a, b, out=out), device, repeats)
                  for _ in range(1 if cuda else 5))
    return significant(2 * size ** 3 / seconds / 1e12)


def copy_bandwidth(device, gib: float | None = None, repeats: int = 10) -> float:
    """Device-to-device copy GB/s, bytes read + written (2 GiB on CUDA: the practical HBM
    limit; 1/16 GiB elsewhere)."""
    gib = gib or (2.0 if torch.device(device).type == "cuda" else 1 / 16)
    src = torch.empty(int(gib * 2 ** 30), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = device_seconds(lambda: dst.copy_(src), device, repeats)
    return significant(2 * src.numel() / seconds / 1e9)


# ------------------------------------------------------------------------- the work done
@dataclass(frozen=True)
class ModelCosts:
    rounds: int
    linear_params: int           # weights of the shared layers' matmuls (one round)
    layer_bytes: int             # every shared-layer parameter: read once per round step
    head_params: int
    head_bytes: int
    attn_flops_per_pair: int     # QK^T + PV FLOPs of one (query, key) pair, every layer
    kv_bytes_per_position: int   # K + V of one position in one plane, every layer

    @staticmethod
    def of(model) -> "ModelCosts":
        cfg, layers, head = model.config, model.model.layers, model.lm_head.weight
        return ModelCosts(
            rounds=cfg.num_rounds,
            linear_params=sum(m.weight.numel() for m in layers.modules()
                              if isinstance(m, torch.nn.Linear)),
            layer_bytes=sum(p.numel() * p.element_size() for p in layers.parameters()),
            head_params=head.numel(), head_bytes=head.numel() * head.element_size(),
            attn_flops_per_pair=4 * cfg.num_hidden_layers * cfg.num_attention_heads
            * cfg.head_dim,
            kv_bytes_per_position=cfg.num_hidden_layers * 2 * cfg.num_key_value_heads
            * cfg.head_dim * head.element_size())


def prefill_flops(costs: ModelCosts, prompt_len: int) -> int:
    pairs = prompt_len * (prompt_len + 1) // 2
    return costs.rounds * (2 * costs.linear_params * prompt_len
                           + costs.attn_flops_per_pair * pairs) + 2 * costs.head_params


def prefill_flops_by_class(costs: ModelCosts, work: dict) -> dict:
    """A prefill-only run's FLOPs (work_of's) split as a kernel profile splits its time:
    matmul (every round's linear layers over the prompt tokens, and the LM head once per
    request) and attention (the rest: causal query-key pairs)."""
    matmul = costs.rounds * 2 * costs.linear_params * work["prefill_tokens"] \
        + 2 * costs.head_params * work["requests"]
    return {"matmul": matmul, "attention": work["prefill_flops"] - matmul}


def tflop_s_by_class(flops: dict, kernel_ms: dict) -> dict:
    """TFLOP/s of each kernel class that has both FLOPs and kernel time."""
    return {name: significant(flops[name] / (kernel_ms[name] * 1e-3) / 1e12)
            for name in flops if kernel_ms.get(name)}


def work_of(costs: ModelCosts, outputs, shared_block: int = 0) -> dict:
    """What a run computed, from its RequestOutputs: prompts prefilled (once per request),
    output tokens, decode positions, their executed rounds and the K/V positions they read.
    shared_block: the block size if the engine read a group's shared prompt blocks once per
    group (ExecutionConfig.shared_prefix_attention), else 0: then those positions count once per
    decode step of the group (at its deepest member's rounds) instead of once per sample."""
    work = dict(requests=0, prefill_tokens=0, prefill_flops=0, output_tokens=0,
                decode_tokens=0, decode_row_rounds=0, kv_read_positions=0)
    for out in outputs:
        prompt = len(out.prompt_token_ids)
        work["requests"] += 1
        work["prefill_tokens"] += prompt
        work["prefill_flops"] += prefill_flops(costs, prompt)
        # (for one sample the split changes nothing: its steps are its own)
        shared = prompt // shared_block * shared_block if shared_block else 0
        steps: dict[int, int] = {}   # decode step -> the deepest member's rounds there
        for completion in out.outputs:
            depths = completion.executed_depths
            work["output_tokens"] += len(depths)
            work["decode_tokens"] += max(len(depths) - 1, 0)
            work["decode_row_rounds"] += sum(depths[1:])
            work["kv_read_positions"] += sum(d * (prompt + i - shared)
                                             for i, d in enumerate(depths[1:], start=1))
            for i, d in enumerate(depths[1:], start=1):
                steps[i] = max(steps.get(i, 0), d)
        work["kv_read_positions"] += shared * sum(steps.values())
    return work


def mean_executed_rounds(work: dict) -> float | None:
    return work["decode_row_rounds"] / work["decode_tokens"] if work["decode_tokens"] else None


def ceiling(costs: ModelCosts, work: dict, rows: int, tflop_s: float, copy_gb_s: float
            ) -> dict:
    """The work's time floor (prefill at the matmul rate + decode bytes at the copy
    bandwidth) -> ceiling_tok_s (output tokens) and decode_ceiling_tok_s (decode tokens over
    the decode floor alone). rows: sequences that may share one round step's weight read."""
    prefill_s = work["prefill_flops"] / (tflop_s * 1e12)
    weight_bytes = (work["decode_row_rounds"] * costs.layer_bytes
                    + work["decode_tokens"] * costs.head_bytes) / rows
    kv_bytes = work["kv_read_positions"] * costs.kv_bytes_per_position
    decode_s = (weight_bytes + kv_bytes) / (copy_gb_s * 1e9)
    total = prefill_s + decode_s
    return {"prefill_floor_s": prefill_s, "decode_floor_s": decode_s,
            "ceiling_tok_s": work["output_tokens"] / total if total else None,
            "decode_ceiling_tok_s": work["decode_tokens"] / decode_s if decode_s else None}


def significant(value: float, digits: int = 4) -> float:
    return float(f"{value:.{digits}g}")


def pct(value: float | None, limit: float | None) -> float | None:
    return round(100 * value / limit, 1) if value and limit else None


# ---------------------------------------------------------------------------- depth pairs
def ideal_e2e_gain(prefill_s: float, decode_s: float, cheap_rounds: float,
                   base_rounds: float) -> float:
    """(prefill + decode) / (prefill + decode x cheap_rounds / base_rounds): the end-to-end
    gain if fewer rounds shrank only the decode phase."""
    return (prefill_s + decode_s) / (prefill_s + decode_s * cheap_rounds / base_rounds)


def depth_pair(base: dict, cheap: dict) -> dict | None:
    """e2e_gain, ideal_e2e_gain and pct_of_ideal_e2e of one mode's baseline / cheap results
    (each with closed_loop incl. work, decode, and prefill from the same run).
    pct_of_ideal_e2e is the share of the ideal SAVINGS reached, 100 (gain - 1) / (ideal - 1):
    a ratio of the gains themselves would call no gain at all (1.0x of an ideal 1.17x) 85%."""
    try:
        base_loop, cheap_loop = base["closed_loop"], cheap["closed_loop"]
        prefill_s = base["prefill"]["wall_s"]
        decode_s = base_loop["work"]["decode_tokens"] / base["decode"]["decode_tok_s"]
    except (KeyError, ZeroDivisionError):   # a mode that failed or ran no closed loop
        return None
    base_rounds = mean_executed_rounds(base_loop["work"])
    cheap_rounds = mean_executed_rounds(cheap_loop["work"])
    ideal = ideal_e2e_gain(prefill_s, decode_s, cheap_rounds, base_rounds)
    gain = cheap_loop["tok_s"] / base_loop["tok_s"]
    return {"e2e_gain": round(gain, 3), "ideal_e2e_gain": round(ideal, 3),
            "pct_of_ideal_e2e": round(100 * (gain - 1) / (ideal - 1), 1) if ideal > 1 else None,
            "decode_gain": round(cheap["decode"]["decode_tok_s"]
                                 / base["decode"]["decode_tok_s"], 3),
            "prefill_s": round(prefill_s, 4), "decode_s": round(decode_s, 4),
            "base_rounds": round(base_rounds, 3), "cheap_rounds": round(cheap_rounds, 3)}


# ------------------------------------------------------------------- the bench's results
def annotate(entry: dict, costs: ModelCosts, rows: int, tflop_s: float, copy_gb_s: float
             ) -> None:
    """Add to every mode of a workload entry (in place): prefill_pct_of_matmul (prefill-only
    run), ceiling_tok_s / pct_of_ceiling of the closed loop and of the decode phase, and the
    headline pair at the mode's top level: the closed loop's, or the decode phase's if the
    workload has no closed loop (W1). An `independent` run (W5) is read against the same
    ceiling (the task's: each prompt prefilled once)."""
    for res in entry["modes"].values():
        prefill = res.get("prefill")
        if prefill and "work" in prefill:
            rate = prefill["work"]["prefill_flops"] / prefill["wall_s"] / 1e12
            prefill["tflop_s"] = significant(rate)
            prefill["prefill_pct_of_matmul"] = res["prefill_pct_of_matmul"] = pct(rate, tflop_s)
        decode = res.get("decode")
        if decode and "work" in decode:
            limit = ceiling(costs, decode["work"], rows, tflop_s, copy_gb_s)
            decode["ceiling_tok_s"] = _round(limit["decode_ceiling_tok_s"])
            decode["pct_of_ceiling"] = pct(decode["decode_tok_s"], limit["decode_ceiling_tok_s"])
            res["ceiling_tok_s"], res["pct_of_ceiling"] = \
                decode["ceiling_tok_s"], decode["pct_of_ceiling"]
        loop = res.get("closed_loop")
        if loop and "work" in loop:
            limit = ceiling(costs, loop["work"], rows, tflop_s, copy_gb_s)
            loop["floor_s"] = {"prefill": round(limit["prefill_floor_s"], 4),
                               "decode": round(limit["decode_floor_s"], 4)}
            loop["ceiling_tok_s"] = _round(limit["ceiling_tok_s"])
            loop["pct_of_ceiling"] = pct(loop["tok_s"], limit["ceiling_tok_s"])
            res["ceiling_tok_s"], res["pct_of_ceiling"] = \
                loop["ceiling_tok_s"], loop["pct_of_ceiling"]
            if "independent" in res:
                res["independent"]["pct_of_ceiling"] = pct(res["independent"]["tok_s"],
                                                           limit["ceiling_tok_s"])
                if "work" in res["independent"]:
                    res.update(group_ideal(costs, loop["work"], res["independent"]["work"],
                                           rows, tflop_s, copy_gb_s, res.get("group_speedup")))


def group_ideal(costs: ModelCosts, grouped: dict, independent: dict, rows: int,
                tflop_s: float, copy_gb_s: float, speedup: float | None) -> dict:
    """W5's ideal group gain: the independent run's time floor over the grouped run's (each
    prompt prefilled once per group instead of once per sample, and a group's shared prompt
    K/V read once per decode step instead of once per sample; the same weight reads), and the
    share of its savings the measured group_speedup reached, 100 (speedup - 1) / (ideal - 1)."""
    def floor(work):
        limit = ceiling(costs, work, rows, tflop_s, copy_gb_s)
        return limit["prefill_floor_s"] + limit["decode_floor_s"]
    ideal = floor(independent) / floor(grouped)
    share = 100 * (speedup - 1) / (ideal - 1) if speedup is not None and ideal > 1 else None
    return {"ideal_group_gain": round(ideal, 3),
            "group_pct_of_ideal": None if share is None else round(share, 1)}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)
