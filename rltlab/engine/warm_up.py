"""LLM.warm_up(): the one-off costs of a closed loop paid before it, not inside a user's run.

On CUDA the engine captures a graph the first time it meets a shape (a decode batch bucket at a
depth, a round window's bucket, a whole-prompt step's (prompts, length, rounds) bucket) and
Triton and cuDNN specialise kernels on first use. A closed loop meets those shapes as its
batch fills and drains, so without a warm-up its first pass pays them mid-rollout.

warm_up() runs synthetic closed loops (random token ids, outputs discarded) that walk through
every shape a loop of the given size reaches:
  - decode: a closed loop of 2 x `concurrency` requests (prompts of every length bucket up to
    `prompt_len`, admitted as others finish) whose lengths are staggered, so the running batch
    steps down through every batch bucket, once per exit regime: each fixed depth 1..R
    (whole-token windows), a replayed mix of depths (round windows) and the stock Q-exit
    (per-round steps reading the gate); with `group_size` g > 1, every regime again with
    requests of n = g samples at temperature 1 (the GRPO shape): rows of one prompt read its
    K/V once (prefix_groups.py), through graphs of their own, and the sampler draws;
  - whole tokens at every batch bucket: a window keeps its batch (finished rows pad it to its
    end, token_window.py), so the loops above meet whole-token graphs only at the batch sizes
    their windows start at; one short generate of b rows per bucket b and fixed depth (grouped
    too, with g > 1) reaches the rest, which a loop whose rows end one by one (EOS-terminated
    samples) meets as it drains;
  - prefill: whole prompts of each length bucket up to `prompt_len` (or, given a list of
    lengths, of the buckets those lengths fall in), admitted 1, 2, 4 and 8 at a time, each shape twice (graphs are captured at a bucket's second step) and, past
    ExecutionConfig.cudnn_prefill_after, as often as it takes cuDNN to take over.
Nothing it does changes a later request's output: its requests finish and free their blocks.
Off CUDA there is nothing to capture; it returns at once.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch
from tqdm.auto import tqdm

from rltlab.engine.fused_prefill import length_bucket
from rltlab.engine.sampling import SamplingParams

PROMPT_COUNTS = (1, 2, 4, 8)   # whole-prompt steps are bucketed by these counts


def decode_phases(num_rounds: int, group_size: int = 1) -> list[tuple[str, dict]]:
    """(name, SamplingParams fields) of each exit regime a decode loop is warmed in, greedy;
    with group_size > 1, each again as groups of that many samples at temperature 1."""
    phases = [(f"fixed depth {d}", {"exit_policy": "fixed", "exit_policy_args": {"depth": d},
                                    "min_loops": 1}) for d in range(1, num_rounds + 1)]
    phases.append(("mixed depths", {"exit_policy": "trace"}))
    phases.append(("q_exit", {"exit_policy": "q_exit", "exit_threshold": 0.5, "min_loops": 1}))
    phases = [(name, {**fields, "temperature": 0.0}) for name, fields in phases]
    if group_size > 1:
        phases += [(f"{name}, groups of {group_size}",
                    {**fields, "n": group_size, "temperature": 1.0, "logprobs": 0})
                   for name, fields in phases]
    return phases


def prompt_lengths(prompt_len: int | Sequence[int]) -> list[int]:
    """One prompt length per length bucket (fused_prefill.length_bucket): every bucket up to
    prompt_len's for an int (the loop's prompts are unknown), only the buckets of the given
    lengths for a list (the longest given length of each)."""
    if not isinstance(prompt_len, int):
        longest: dict[int, int] = {}
        for n in prompt_len:
            longest[length_bucket(n)] = max(n, longest.get(length_bucket(n), 0))
        return sorted(longest.values())
    lengths, n = [], 1
    while True:
        top = length_bucket(n)
        lengths.append(min(top, prompt_len))
        if top >= length_bucket(prompt_len):
            return sorted(set(lengths))
        n = top + 1


def warm_up(engine, *, concurrency: int | None = None, prompt_len: int | Sequence[int] = 128,
            max_tokens: int = 32, group_size: int = 1, progress: bool = True,
            off_cuda: bool = False) -> dict:
    """Run the synthetic loops (module docstring) on an idle engine -> {"seconds", "loops",
    "graphs"} (graphs: the static decoder's captured graphs after it). concurrency: the most
    requests a loop will hold (default: max_num_seqs); prompt_len: the longest prompt a loop
    will see, or the list of its prompts' lengths (fewer buckets to warm); max_tokens: decode
    tokens per warm-up request (the windows need a few); group_size: the loop's samples per
    prompt (SamplingParams.n), where > 1 its grouped shapes are warmed too.
    off_cuda: run the loops off CUDA too (they capture nothing there: for tests)."""
    if engine.has_unfinished_requests():
        raise RuntimeError("warm_up() needs an idle engine: finish or abort the running "
                           "requests first")
    device = next(engine.model.parameters()).device
    if device.type != "cuda" and not off_cuda:
        return {"seconds": 0.0, "loops": 0, "graphs": 0}
    limit = engine.config.max_num_seqs
    concurrency = limit if concurrency is None else concurrency
    if not 1 <= concurrency <= limit:
        raise ValueError(f"concurrency must lie in 1..max_num_seqs={limit}, got {concurrency}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) \
            or not 1 <= group_size <= concurrency:
        raise ValueError(f"group_size must be an int in 1..concurrency={concurrency}, "
                         f"got {group_size!r}")
    longest = engine.max_model_len - max_tokens
    given = [prompt_len] if isinstance(prompt_len, int) else list(prompt_len)
    bad = next((n for n in given if isinstance(n, bool) or not isinstance(n, int)
                or not 1 <= n <= longest), None) if given else "an empty list"
    if bad is not None:
        raise ValueError(f"prompt_len must lie in 1..{longest} (max_model_len - max_tokens), "
                         f"got {bad!r}")
    R, vocab = engine.num_rounds, engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    phases = decode_phases(R, group_size)
    lengths = prompt_lengths(prompt_len)
    repeats = 2 + (engine.config.execution.cudnn_prefill_after or 0) // R
    prefill = [(n, length) for length in lengths for n in PROMPT_COUNTS if n <= concurrency]
    static = getattr(engine.runner, "static", None)
    sweeps = bucket_sweeps(static.buckets if static is not None else [], concurrency, R,
                           group_size)
    bar = tqdm(total=len(phases) + len(sweeps) + len(prefill), desc="warm-up", unit="loop",
               disable=not progress)
    start = time.perf_counter()
    for name, fields in phases:
        # a closed loop of 2 x concurrency sequences: the second half is admitted as the first
        # finishes (prefill steps beside decode rows); request i ends after a number of tokens
        # that puts the running batch in each size, so in each bucket, in turn
        requests = 2 * concurrency // fields.get("n", 1)
        budget = [max_tokens + (i * max_tokens) // requests for i in range(requests)]
        params = []
        for i, tokens in enumerate(budget):
            args = dict(fields.get("exit_policy_args", {}))
            if fields["exit_policy"] == "trace":
                args["depths"] = [R] + torch.randint(1, R + 1, (tokens,), generator=gen).tolist()
            params.append(SamplingParams(**{**fields, "exit_policy_args": args},
                                         max_tokens=tokens, ignore_eos=True, seed=i))
        prompts = [_prompts(1, lengths[i % len(lengths)], vocab, gen)[0]
                   for i in range(requests)]
        _generate(engine, prompts, params)
        bar.set_postfix_str(name)
        bar.update()
    short = engine.config.block_size + 1   # cheap prompts whose groups share a whole block
    for rows, depth, n in sweeps:
        fields = {"exit_policy": "fixed", "exit_policy_args": {"depth": depth}, "min_loops": 1,
                  "n": n, "temperature": 1.0 if n > 1 else 0.0, "logprobs": 0 if n > 1 else None}
        _generate(engine, _prompts(rows // n, short, vocab, gen),
                  [SamplingParams(**fields, max_tokens=2, ignore_eos=True, seed=i)
                   for i in range(rows // n)])
        bar.set_postfix_str(f"{rows} rows at depth {depth}" + (", grouped" if n > 1 else ""))
        bar.update()
    for count, length in prefill:
        for _ in range(repeats):
            prompts = _prompts(count, length, vocab, gen)
            _generate(engine, prompts, [SamplingParams(temperature=0.0, max_tokens=2,
                                                       ignore_eos=True)] * count)
        bar.set_postfix_str(f"{count} x {length}-token prompts")
        bar.update()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    bar.close()
    seconds = time.perf_counter() - start
    graphs = len(getattr(static, "_graphs", {})) if static is not None else 0
    return {"seconds": seconds, "loops": len(phases) + len(sweeps) + len(prefill) * repeats,
            "graphs": graphs}


def bucket_sweeps(buckets: Sequence[int], concurrency: int, num_rounds: int,
                  group_size: int = 1) -> list[tuple[int, int, int]]:
    """(rows, depth, samples per request) of each whole-token sweep generate: every batch bucket
    up to `concurrency` at every fixed depth, as single requests and, with group_size g > 1, as
    requests of n = min(g, bucket) samples (bucket a multiple of n: the batch is the bucket)."""
    out = []
    for bucket in (b for b in buckets if b <= concurrency):
        for depth in range(1, num_rounds + 1):
            out.append((bucket, depth, 1))
            n = min(group_size, bucket)
            if group_size > 1 and bucket % n == 0 and n > 1:
                out.append((bucket, depth, n))
    return out


def _prompts(count: int, length: int, vocab: int, gen: torch.Generator) -> list[list[int]]:
    return torch.randint(1, vocab, (count, length), generator=gen).tolist()


def _generate(engine, prompts, params) -> None:
    ids = [engine.add_request(None, prompt, p) for prompt, p in zip(prompts, params)]
    try:
        while engine.has_unfinished_requests():
            engine.step()
    except BaseException:
        engine.abort_request(ids)
        engine._drain_outputs()
        raise
