"""Small-batch GEMV (kernels/small_batch.small_m_linear) vs cuBLAS on one decode round's weights.

    python -m rltlab.bench.gemv --preset ouro-1.4b [--rows 1 2 4 8 16] [--sweep] [--pdl]
                                [--shapes o down] [--out FILE]
    python -m rltlab.bench.gemv --config artifacts/ouro-tiny/config.json --dtype float32 \
                                --rows 1 5 16 37 --sweep

For a model shape, the four matmuls of a layer (q/k/v fused, o, gate/up fused, down with
SiLU * up) with L distinct weight copies each (L = num_hidden_layers, so the weights stream
from HBM as in a real round instead of sitting in the 50 MB L2). Per row count: correctness
(max abs error vs the fp32 product of the same bf16 inputs), then the time of one round's matmuls
(a CUDA graph of all L x 4, median of repeats) for cuBLAS (F.linear; SiLU * up as its own
kernels) and for the Triton kernel, in GB/s and as a % of the device copy bandwidth measured in
the same run. --sweep times tile configurations per weight shape first (--shapes: only those),
the default tiles among them, and reports the best as (BLOCK_N, BLOCK_K, num_warps,
num_stages, SPLIT_K); split-K candidates (kernels/small_batch.py) are among them, for the narrow o
and down projections.
--pdl launches the Triton kernels with programmatic dependent launch (rltlab.kernels.pdl), as the
engine's one-row rounds do on Hopper; its sweep then covers the one-row tiles only.
--cublas-rows M [M ...] also times cuBLAS alone on each matmul at those row counts (any M, e.g.
the 128 rows of a closed loop's decode step, where the engine leaves every matmul to cuBLAS):
ms per call, and the share of the copy bandwidth its weight bytes reach (the weakest shape is
where a decode step's matmul time goes past its weight bytes).
--config takes the shape from a config.json instead of --preset; --dtype float32 times the fp32
paths (several rows as FMA products, kernels/small_batch.py); its sweep covers only the FMA
tiles, at each --rows count above one.
Last line: JSON.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics

import torch
import torch.nn.functional as F

from rltlab.common.atomic import write_text_atomic
from rltlab.bench.ceilings import copy_bandwidth
from rltlab.kernels.small_batch import check_tiles, small_m_linear, small_m_linear_ref, tiles_for

# (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K); the stages are swept after the rest. One
# row: 36 tiles without split-K, and 81 with 2, 4 or 8 splits for BLOCK_N <= 16 (more programs
# for narrow N); a shape's sweep skips the splits its K has too few BLOCK_K tiles for.
ONE_ROW = ([(bn, bk, w, 3, 1) for bn, bk, w in itertools.product((4, 8, 16, 32), (256, 512, 1024),
                                                                   (2, 4, 8))]
           + [(bn, bk, w, 3, s) for bn, bk, w, s in itertools.product((4, 8, 16), (256, 512, 1024),
                                                                        (2, 4, 8), (2, 4, 8))])
# bf16 rows (tl.dot): 18 tiles without split-K and 18 with 2, 4 or 8 splits (a 16-row block's
# wide BLOCK_N leaves N / BLOCK_N = 32-128 programs on a narrow weight without them).
FEW_ROWS = ([(bn, bk, w, 3, 1) for bn, bk, w in itertools.product((16, 32, 64), (64, 128, 256),
                                                                   (4, 8))]
            + [(bn, bk, 4, 3, s) for bn, bk, s in itertools.product((16, 32, 64), (64, 128),
                                                                     (2, 4, 8))])
# fp32 rows as FMA products: [BLOCK_M, BLOCK_N, BLOCK_K] in registers, so narrow and short tiles.
FEW_ROWS_FMA = [(bn, bk, w, 3, 1)
                for bn, bk, w in itertools.product((1, 2, 4, 8), (32, 64, 128, 256), (1, 2, 4))]


def layer_shapes(cfg) -> dict[str, tuple[int, int, str | None]]:
    """name -> (N, K, act) of one layer's matmuls."""
    h, d = cfg.hidden_size, cfg.head_dim
    return {"qkv": ((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d, h, None),
            "o": (h, cfg.num_attention_heads * d, None),
            "gate_up": (2 * cfg.intermediate_size, h, None),
            "down": (h, cfg.intermediate_size, "silu_mul")}


def graph_ms(fn, repeats: int) -> float:
    """Median ms of one replay of a CUDA graph of fn (captured after a warm-up call)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def fits(tiles, rows: int, n: int, k: int, fma: bool) -> bool:
    """Whether small_m_linear takes these tiles for the shape (split-K needs K tiles to split)."""
    try:
        check_tiles(tiles, rows, n, k, fma)
    except ValueError:
        return False
    return True


def cublas(x, w, act):
    return F.linear(x, w) if act is None else small_m_linear_ref(x, w, act)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m rltlab.bench.gemv",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="ouro-1.4b", help="a preset of rltlab.bench (shape only)")
    ap.add_argument("--config", default=None, help="a config.json to take the shape from instead")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--sweep", action="store_true", help="tune tiles per shape first")
    ap.add_argument("--pdl", action="store_true",
                    help="launch the Triton kernels with programmatic dependent launch")
    ap.add_argument("--shapes", nargs="+", default=None,
                    choices=("qkv", "o", "gate_up", "down"),
                    help="sweep only these of the layer's matmuls (default: all four)")
    ap.add_argument("--cublas-rows", type=int, nargs="+", default=[], metavar="M",
                    help="also time cuBLAS alone per matmul at these row counts: ms per call "
                         "and %% of the copy bandwidth its weight bytes reach")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if any(m < 1 for m in args.rows + args.cublas_rows):
        ap.error("--rows and --cublas-rows take row counts >= 1")
    if not torch.cuda.is_available():
        raise SystemExit("rltlab.bench.gemv times CUDA graphs: it needs a GPU")
    from rltlab.model.presets import PRESETS
    from rltlab.model.architecture import OuroConfig
    cfg = (OuroConfig.from_json_file(args.config) if args.config
           else OuroConfig(**PRESETS[args.preset]))
    layers, dev, dtype = cfg.num_hidden_layers, "cuda", getattr(torch, args.dtype)
    fma = dtype == torch.float32
    gen = torch.Generator(device=dev).manual_seed(0)
    shapes = layer_shapes(cfg)
    weights = {name: [torch.randn(n, k, device=dev, dtype=dtype, generator=gen) * k ** -0.5
                      for _ in range(layers)] for name, (n, k, _) in shapes.items()}
    round_bytes = sum(w.numel() * w.element_size() for ws in weights.values() for w in ws)
    result = {"preset": args.config or args.preset, "dtype": args.dtype,
              "device": torch.cuda.get_device_name(),
              "pdl": args.pdl,
              "copy_bandwidth_gb_s": copy_bandwidth(dev), "round_weight_bytes": round_bytes,
              "tiles": {}, "rows": {}, "cublas_rows": {}}

    triton_gemv = functools.partial(small_m_linear, pdl=args.pdl)

    def inputs(m):
        return {name: torch.randn(m, 2 * k if act else k, device=dev, dtype=dtype, generator=gen)
                for name, (n, k, act) in shapes.items()}

    if args.sweep:
        if fma:
            kinds = [("few_rows_fma", m, FEW_ROWS_FMA) for m in args.rows if m > 1]
        else:
            kinds = [("one_row", 1, ONE_ROW)] + ([] if args.pdl else [("few_rows", 16, FEW_ROWS)])
        for kind, m, configs in kinds:
            xs = inputs(m)
            for name, (n, k, act) in shapes.items():
                if args.shapes and name not in args.shapes:
                    continue
                default = check_tiles(tiles_for(m, n, k, fma), m, n, k, fma)
                timed = {}
                candidates = [t for t in configs if fits(t, m, n, k, fma)]
                for tiles in candidates + ([default] if default not in candidates else []):
                    try:
                        timed[tiles] = graph_ms(lambda: [triton_gemv(xs[name], w, act, tiles)
                                                         for w in weights[name]], args.repeats)
                    except Exception as err:   # a tile shape the compiler refuses
                        print(f"skip {kind} {name} {tiles}: {repr(err)[:80]}")
                best = min(timed, key=timed.get)
                with_stages = {s: (*best[:3], s, best[4]) for s in (2, 3, 4, 5)}
                stages = {s: graph_ms(lambda: [triton_gemv(xs[name], w, act, tiles)
                                               for w in weights[name]], args.repeats)
                          for s, tiles in with_stages.items()}
                best = with_stages[min(stages, key=stages.get)]
                key = f"{kind} M={m} {name} N={n} K={k}"
                result["tiles"][key] = {"best": best, "ms": round(min(stages.values()), 4),
                                        "default_ms": round(timed.get(default, float("nan")), 4)}
                print(key, result["tiles"][key], flush=True)

    for m in args.rows:
        xs = inputs(m)
        errors = {}
        for name, (n, k, act) in shapes.items():
            out = small_m_linear(xs[name], weights[name][0], act).float()
            ref = small_m_linear_ref(xs[name].float(), weights[name][0].float(), act)
            errors[name] = round(float((out - ref).abs().max() / ref.abs().max()), 5)
        ms = {}
        for label, fn in (("cublas", cublas), ("triton", triton_gemv)):
            ms[label] = graph_ms(lambda: [fn(xs[name], w, act) for name, (_, _, act)
                                          in shapes.items() for w in weights[name]], args.repeats)
        result["rows"][m] = {
            "max_rel_error": errors,
            **{f"{label}_ms": round(t, 4) for label, t in ms.items()},
            **{f"{label}_pct_of_copy_bw": round(100 * round_bytes / (t / 1e3) / 1e9
                                                / result["copy_bandwidth_gb_s"], 1)
               for label, t in ms.items()},
            "speedup": round(ms["cublas"] / ms["triton"], 3)}
        print(f"rows={m}: {json.dumps(result['rows'][m])}", flush=True)
    for m in args.cublas_rows:
        per_shape = {}
        for name, (n, k, _) in shapes.items():
            x = torch.randn(m, k, device=dev, dtype=dtype, generator=gen)
            ms = graph_ms(lambda: [F.linear(x, w) for w in weights[name]], args.repeats) / layers
            weight_bytes = n * k * dtype.itemsize
            per_shape[name] = {
                "N": n, "K": k, "ms_per_call": round(ms, 5),
                "weight_pct_of_copy_bw": round(100 * weight_bytes / (ms / 1e3) / 1e9
                                               / result["copy_bandwidth_gb_s"], 1)}
        result["cublas_rows"][m] = per_shape
        print(f"cublas rows={m}: {json.dumps(per_shape)}", flush=True)
    if args.out:
        write_text_atomic(args.out, json.dumps(result, indent=1))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    from rltlab.common.command import run_command

    run_command(main)
