"""Issue 17 (W7/W6): what one round step's greedy exit work costs on the device, by kernel, at
the Ouro-1.4B shape, for the number of rows that exit.

    python docs/experiments/scripts/w7_exit_kernels_h200.py

W7 (128 rows, mean 2.8 rounds) runs its exit work once per round step for ~46 exiting rows; W6
runs it once per 4-round token for all 128 rows. Per exit count M: the median time of one call
(CUDA graphs of four calls over four distinct LM head copies, so the weights stream from HBM as
in decoding: rltlab.bench.gemv.graph_ms) of
  * lm_head: the [M, hidden] x [hidden, vocab] GEMM (cuBLAS, what the engine runs), with its
    GB/s and % of the copy bandwidth measured in the same run;
  * greedy: kernels.greedy_tokens over the [M, vocab] logits;
  * exit chain: what round_window runs per step for greedy rows (window_io.sample_rows):
    gather the rows' h, LM head, greedy_tokens, scatter into the pending tokens, the NaN
    log-prob placeholder;
  * next input: the starting rows' embeddings (index_select, embedding, index_copy_) and the
    hidden copy of a 128-row step.
Last line: JSON.
"""
import argparse
import json

import torch
import torch.nn.functional as F

from rltlab.bench.__main__ import PRESETS
from rltlab.bench.ceilings import copy_bandwidth
from rltlab.bench.gemv import graph_ms
from rltlab.kernels.greedy import greedy_tokens
from rltlab.model.config import OuroConfig


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="ouro-1.4b")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32, 46, 64, 96, 128])
    ap.add_argument("--batch", type=int, default=128, help="rows of the round step")
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    cfg = OuroConfig(**PRESETS[args.preset])
    vocab, hidden, b = cfg.vocab_size, cfg.hidden_size, args.batch
    gen = torch.Generator(device="cuda").manual_seed(0)
    heads = [(torch.randn(vocab, hidden, device="cuda", generator=gen) * hidden ** -0.5)
             .bfloat16() for _ in range(4)]
    embed = torch.randn(vocab, hidden, device="cuda", generator=gen).bfloat16()
    hidden_out = torch.randn(b, hidden, device="cuda", generator=gen).bfloat16()
    hidden_in = torch.empty_like(hidden_out)
    pending = torch.randint(0, vocab, (b,), device="cuda", generator=gen)
    copy_gb_s = copy_bandwidth("cuda")
    rows_out = {}
    for m in args.rows:
        rows = torch.randperm(b, device="cuda", generator=gen)[:m].sort().values
        x = hidden_out.index_select(0, rows)
        logits = F.linear(x, heads[0])

        def chain(w):
            tokens, finite = greedy_tokens(F.linear(hidden_out.index_select(0, rows), w))
            pending.index_copy_(0, rows, tokens)
            return finite, torch.full(tokens.shape, float("nan"), device="cuda")

        def next_input():
            hidden_in.copy_(hidden_out)
            hidden_in.index_copy_(0, rows, F.embedding(pending.index_select(0, rows), embed))

        per_call = {
            "lm_head": graph_ms(lambda: [F.linear(x, w) for w in heads], args.repeats) / 4,
            "greedy": graph_ms(lambda: [greedy_tokens(logits) for _ in heads], args.repeats) / 4,
            "exit_chain": graph_ms(lambda: [chain(w) for w in heads], args.repeats) / 4,
            "next_input": graph_ms(lambda: [next_input() for _ in heads], args.repeats) / 4}
        gb_s = heads[0].nbytes / per_call["lm_head"] / 1e6
        rows_out[m] = {**{k: round(v * 1e3, 2) for k, v in per_call.items()},
                       "lm_head_gb_s": round(gb_s, 1),
                       "lm_head_pct_of_copy": round(100 * gb_s / copy_gb_s, 1)}
        print(m, json.dumps(rows_out[m]), flush=True)
    out = {"shape": [vocab, hidden], "batch": b, "dtype": "bfloat16", "unit": "us per call",
           "copy_gb_s": round(copy_gb_s, 1), "rows": rows_out}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
