"""Issue 17 (W1): the one-row LM head through cuBLAS (what the engine runs: model.lm_head) against
the one-row Triton GEMV (kernels.small_m_linear) at a few tiles.

    python docs/experiments/scripts/lm_head_gemv_h200.py [--preset ouro-1.4b]

At c = 1 every token reads the [vocab, hidden] LM head once (201 MB at the Ouro-1.4B shape,
bf16), outside the rounds' graphs. Four distinct weight copies stream from HBM as in decoding
(one copy would sit partly in the 50 MB L2 across replays). Per variant: the median time of one
call (a CUDA graph of the four, rltlab.bench.gemv.graph_ms), GB/s and % of the copy bandwidth
measured in the same run, and the max |error| against the fp32 product of the same bf16 inputs.
Last line: JSON.
"""
import argparse
import json

import torch
import torch.nn.functional as F

from rltlab.bench.__main__ import PRESETS
from rltlab.bench.ceilings import copy_bandwidth
from rltlab.bench.gemv import graph_ms
from rltlab.kernels.small_batch import small_m_linear
from rltlab.model.config import OuroConfig

TILES = [None, (4, 1024, 4, 3), (8, 1024, 4, 3), (8, 512, 4, 3), (16, 512, 4, 3),
         (4, 512, 2, 2), (16, 1024, 8, 3), (32, 512, 8, 3)]


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="ouro-1.4b")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    cfg = OuroConfig(**PRESETS[args.preset])
    vocab, hidden = cfg.vocab_size, cfg.hidden_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [(torch.randn(vocab, hidden, device="cuda", generator=gen) * hidden ** -0.5)
               .bfloat16() for _ in range(4)]
    x = torch.randn(1, hidden, device="cuda", generator=gen).bfloat16()
    exact = F.linear(x.float(), weights[0].float())
    nbytes = weights[0].nbytes
    copy_gb_s = copy_bandwidth("cuda")
    variants = {"cublas": lambda w: F.linear(x, w)}
    for tiles in TILES:
        variants[f"triton {tiles or 'default'}"] = (
            lambda w, tiles=tiles: small_m_linear(x, w, tiles=tiles))
    results = {}
    for name, fn in variants.items():
        err = (fn(weights[0]).float() - exact).abs().max().item()
        ms = graph_ms(lambda: [fn(w) for w in weights], args.repeats) / len(weights)
        gb_s = nbytes / ms / 1e6
        results[name] = dict(us_per_call=round(ms * 1e3, 2), gb_s=round(gb_s, 1),
                             pct_of_copy=round(100 * gb_s / copy_gb_s, 1),
                             max_abs_err=err)
        print(f"{name:32s} {ms * 1e3:8.2f} us  {gb_s:7.1f} GB/s  "
              f"{100 * gb_s / copy_gb_s:5.1f}% of copy  err {err:.3g}", flush=True)
    out = dict(shape=[vocab, hidden], dtype="bfloat16", weight_bytes=nbytes,
               copy_gb_s=round(copy_gb_s, 1), variants=results)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
