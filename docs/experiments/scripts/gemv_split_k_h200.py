"""Issue 17 (W1): split-K tiles for the one-row GEMV's narrow shapes (o: N=2048 K=2048; down:
N=2048 K=5632 with SiLU * up), under PDL, as the engine's one-row rounds launch them. Per shape:
a targeted sweep (BLOCK_N 4/8, BLOCK_K 256/512/1024, warps 2/4, SPLIT_K 1/2/4, stages 3; then
stages 2-5 for the best), each timed as a CUDA graph of 24 same-shape GEMVs (distinct weights,
so they stream from HBM), median of 20 replays; the engine's default tiles in the same run.
Then one round's 96 GEMVs (q/k/v, o, gate/up, down x 24) with the default tiles and with the
best o/down tiles. Last line: JSON.

    python docs/experiments/scripts/gemv_split_k_h200.py
"""
import itertools
import json

import torch

from rltlab.bench.__main__ import PRESETS
from rltlab.bench.ceilings import copy_bandwidth
from rltlab.bench.gemv import graph_ms, layer_shapes
from rltlab.kernels.small_batch import check_tiles, small_m_linear, tiles_for
from rltlab.model.architecture import OuroConfig

CANDIDATES = [(bn, bk, w, 3, s) for bn, bk, w, s in
              itertools.product((4, 8), (256, 512, 1024), (2, 4), (1, 2, 4))]


def main() -> dict:
    cfg = OuroConfig(**PRESETS["ouro-1.4b"])
    layers, dev, dtype = cfg.num_hidden_layers, "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    shapes = layer_shapes(cfg)
    weights = {name: [torch.randn(n, k, device=dev, dtype=dtype, generator=gen) * k ** -0.5
                      for _ in range(layers)] for name, (n, k, _) in shapes.items()}
    xs = {name: torch.randn(1, 2 * k if act else k, device=dev, dtype=dtype, generator=gen)
          for name, (n, k, act) in shapes.items()}

    def chain_ms(name, tiles):
        act = shapes[name][2]
        return graph_ms(lambda: [small_m_linear(xs[name], w, act, tiles, pdl=True)
                                 for w in weights[name]], 20)

    result = {"device": torch.cuda.get_device_name(), "copy_bandwidth_gb_s": copy_bandwidth(dev),
              "shapes": {}}
    best_tiles = {}
    for name in ("o", "down"):
        n, k, _ = shapes[name]
        default = check_tiles(tiles_for(1, n, k), 1, n, k)
        timed = {}
        for tiles in CANDIDATES + [default]:
            try:
                check_tiles(tiles, 1, n, k)
            except ValueError:
                continue
            timed[tiles] = chain_ms(name, tiles)
        best = min(timed, key=timed.get)
        staged = {(*best[:3], s, best[4]): None for s in (2, 3, 4, 5)}
        for tiles in staged:
            staged[tiles] = chain_ms(name, tiles)
        best = min(staged, key=staged.get)
        best_tiles[name] = best
        gb = layers * n * k * 2 / 1e9
        result["shapes"][name] = {
            "N": n, "K": k, "default": default, "default_ms": round(chain_ms(name, default), 4),
            "best": best, "best_ms": round(chain_ms(name, best), 4),
            "best_pct_of_copy_bw": round(100 * gb / (staged[best] / 1e3)
                                         / result["copy_bandwidth_gb_s"], 1),
            "top5": sorted(((round(t, 4), c) for c, t in timed.items()))[:5]}
        print(name, json.dumps(result["shapes"][name]), flush=True)

    def round_ms(tiles_of):
        return graph_ms(lambda: [small_m_linear(xs[name], weights[name][i], shapes[name][2],
                                                tiles_of(name), pdl=True)
                                 for i in range(layers) for name in shapes], 20)
    default_round = round_ms(lambda name: None)
    split_round = round_ms(lambda name: best_tiles.get(name))
    result["round"] = {"default_ms": round(default_round, 4), "best_ms": round(split_round, 4),
                       "speedup": round(default_round / split_round, 3)}
    print("round", json.dumps(result["round"]), flush=True)
    return result


if __name__ == "__main__":
    print(json.dumps(main()))
