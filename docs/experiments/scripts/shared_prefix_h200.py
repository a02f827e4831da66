"""Issue 17, W5: where shared-prefix decode attention's time goes, at the Ouro-1.4B shape (bf16,
16 heads, head_dim 128, block 16). Call 2 of the thirteenth session ran W5 with it on at the
same per-token latency as with it off (TPOT 19.0 against 19.2 ms) although the run read 2.6x
fewer K/V positions. Two checks, each against the plain kernels in the same run:

  1. the attention alone (one layer's K/V, CUDA-graph replays): 128 rows in 16 groups of 8
     sharing a 512-token prompt, 1-110 own positions each;
  2. the engine's decode phase alone: 16 prompts x n = 8, all 128 rows in flight, 128 tokens
     each (no stops), random weights; plain and shared engines alternate, repeats times.

Last line: JSON.

    python docs/experiments/scripts/shared_prefix_h200.py [--device cuda] [--preset ouro-1.4b]
"""
import argparse
import json
import statistics
import time

import numpy as np
import torch

from rltlab import kernels
from rltlab.bench.__main__ import add_model_arguments, build_model
from rltlab.engine import LLM, SamplingParams


def attention_case(device, dtype, heads=16, dim=128, groups=16, n=8, prompt=512, block=16,
                   seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = groups * n
    own = torch.randint(1, 111, (rows,), generator=g)
    ctx = (prompt + own).to(torch.int32)
    width = -(-int(ctx.max()) // block)
    num_blocks = groups * (prompt // block) + rows * (width - prompt // block) + 1
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for _ in range(groups):
        common = [free.pop() for _ in range(prompt // block)]
        for _ in range(n):
            tables.append(common + [free.pop() for _ in range(width - prompt // block)])
    tables = torch.tensor(tables, dtype=torch.int32)
    kv = torch.randn(2, 1, num_blocks, block, heads, dim, generator=g).to(dtype)
    q = torch.randn(rows, heads, dim, generator=g).to(dtype)
    planes = torch.zeros(rows, dtype=torch.int32)
    start, length = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
    members = np.full((rows, kernels.MAX_MEMBERS), -1, np.int32)
    made = kernels.shared_prefix_plan(planes.numpy(), ctx.numpy(), tables.numpy(), block, start,
                                      length, members)
    plan = kernels.SharedPrefix(*(torch.from_numpy(a).to(device)
                                  for a in (start, length, members)))
    to = {"device": device}
    return dict(q=q.to(**to), kv=kv.to(**to), planes=planes.to(**to), tables=tables.to(**to),
                ctx=ctx.to(**to), plan=plan, groups=made, max_ctx=width * block,
                kv_bytes_plain=int(ctx.sum()) * 2 * heads * dim * kv.element_size(),
                kv_bytes_shared=(int((ctx - prompt).sum()) + groups * prompt) * 2 * heads * dim
                * kv.element_size())


def time_attention(case, shared: bool, iters: int = 50) -> float:
    """Median microseconds of one call, from CUDA-graph replays of `iters` calls."""
    kw = dict(max_context_len=case["max_ctx"], shared=case["plan"] if shared else None)

    def call():
        return kernels.paged_decode_attention(case["q"], case["kv"][0], case["kv"][1],
                                              case["planes"], case["tables"], case["ctx"],
                                              0.088, **kw)
    if case["q"].device.type != "cuda":
        started = time.perf_counter()
        call()
        return 1e6 * (time.perf_counter() - started)
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            call()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(1e3 * start.elapsed_time(end) / iters)
    return statistics.median(times)


def decode_phase(model, device, repeats: int, prompt: int, tokens: int) -> dict:
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, vocab, (prompt,), generator=g).tolist() for _ in range(16)]
    params = [SamplingParams(n=8, temperature=1.0, seed=i, max_tokens=tokens, ignore_eos=True,
                             exit_policy="fixed") for i in range(16)]
    engines = {shared: LLM(model, device=device, decode_path="static", max_num_seqs=128,
                           kv_cache_memory_gib=8.0, max_model_len=prompt + tokens + 1,
                           shared_prefix_attention=shared) for shared in (False, True)}
    secs = {False: [], True: []}
    for shared, llm in engines.items():   # warm-up: captures and specialisations
        llm.generate(prompts, params)
    for rep in range(repeats):
        for shared in ((False, True) if rep % 2 == 0 else (True, False)):
            torch.cuda.synchronize() if device.type == "cuda" else None
            started = time.perf_counter()
            engines[shared].generate(prompts, params)
            torch.cuda.synchronize() if device.type == "cuda" else None
            secs[shared].append(time.perf_counter() - started)
    out_tokens = 16 * 8 * tokens
    return {"seconds_plain": secs[False], "seconds_shared": secs[True],
            "tok_s_plain": out_tokens / statistics.median(secs[False]),
            "tok_s_shared": out_tokens / statistics.median(secs[True]),
            "paired_speedup": statistics.median(p / s for p, s in zip(secs[False], secs[True]))}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(ap)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args(argv)
    model = build_model(args)
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    case = attention_case(device, dtype, heads=model.config.num_key_value_heads,
                          dim=model.config.head_dim)
    want = kernels.paged_decode_attention(case["q"], case["kv"][0], case["kv"][1],
                                          case["planes"], case["tables"], case["ctx"], 0.088)
    got = kernels.paged_decode_attention(case["q"], case["kv"][0], case["kv"][1],
                                         case["planes"], case["tables"], case["ctx"], 0.088,
                                         shared=case["plan"])
    plain_us, shared_us = time_attention(case, False), time_attention(case, True)
    result = {"attention": {
        "groups": case["groups"], "max_abs_diff": float((got - want).abs().max()),
        "plain_us": round(plain_us, 2), "shared_us": round(shared_us, 2),
        "speedup": round(plain_us / shared_us, 3),
        "plain_tb_s": round(case["kv_bytes_plain"] / plain_us / 1e6, 3),
        "shared_tb_s": round(case["kv_bytes_shared"] / shared_us / 1e6, 3)}}
    print(f"attention, 128 rows / 16 groups: plain {plain_us:.1f} us, shared {shared_us:.1f} us "
          f"({plain_us / shared_us:.2f}x), max |diff| {result['attention']['max_abs_diff']:.3g}")
    result["decode"] = decode_phase(model, device, args.repeats, args.prompt, args.tokens)
    d = result["decode"]
    print(f"decode phase: plain {d['tok_s_plain']:.0f} tok/s, shared {d['tok_s_shared']:.0f} "
          f"tok/s, paired {d['paired_speedup']:.3f}x")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
