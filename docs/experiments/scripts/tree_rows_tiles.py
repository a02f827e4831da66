"""Few-row FMA tiles (kernels.small_batch.TILES["few_rows_fma", N, K]) for the tree program's
rounds, timed where they run: the R static-decoder rounds over a tree iteration's rows,
captured as one CUDA graph (as tree_iteration_split.py) at the lead program's 16 rows and the
heads-only program's 5 (chain K = 4 + lookup 10). The tiles serve every round of 2..64 rows
and never one row, so target-only decoding does not see them. Coordinate descent: each weight
shape's candidates in turn, the others at their best so far; `score` weighs the two row counts
as the adaptive tree path runs them on 32 x 32 (91 of 245 iterations with the lookup rows).

    python docs/experiments/scripts/tree_rows_tiles.py [--replays 100]
Last line: JSON (per shape: the entry before, the best, each candidate's ms).
"""
import argparse
import itertools
import json


from rltlab import kernels
from rltlab.bench.tree_spec import HEADS
from rltlab.draft_heads import lookahead
from rltlab.draft_heads.evaluate import eval_prompts
from rltlab.engine import LLM, SamplingParams, TreeProposer
from rltlab.engine.static_decode import capture_graph
from rltlab.engine.tree_graph import private_blocks
from rltlab.model.checkpoint import load_model
from tree_iteration_split import _graph_ms

TILES = kernels.small_batch.TILES
CHAIN = [tuple([0] * j) for j in range(1, 5)]
LEAD_SHARE = 91 / 245   # iterations with the lookup rows, CPU replay of the adaptive rule


def _rounds_graph(program, n: int):
    """The iteration's R rounds over its first n rows, on the indices its _prepare makes now."""
    st = program.static
    token, base, left, cap, valid = (program.index[i: i + 1] for i in range(5))
    at = program._history_at
    x, *_, index, rope = program._prepare(token, base, left, cap, program.index[5: at],
                                          program.tree.cand_in, program.index[at:])
    index = tuple(t[:n] for t in index)

    def rounds():
        for r in range(st.config.num_rounds):
            st._round(n, plane=r, rows=index, x=x[:n] if r == 0 else st.hidden_out[:n],
                      rope=rope)
    return capture_graph(rounds, None)


def _ms(graph, replays: int) -> float:
    """tree_iteration_split's timer after five warm-up replays."""
    for _ in range(5):
        graph.replay()
    return _graph_ms(graph, replays)


def _candidates(rope: bool):
    widths = (2, 4, 8, 16) if rope else (1, 2, 4, 8)   # rope: twice a power of two
    for n, k, warps in itertools.product(widths, (64, 128, 256), (1, 2, 4)):
        if n * k <= 512 * warps:   # the [16, N, K] fp32 products in registers
            yield (n, k, warps, 2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--replays", type=int, default=100)
    args = ap.parse_args()
    model, tok, md = load_model(None, dtype="float32", device="cuda")
    heads, _, _ = lookahead.load(HEADS, model)
    prompts = eval_prompts(tok, md, 2)
    max_len = max(map(len, prompts)) + 33
    proposer = TreeProposer(heads, CHAIN, lookup=10)
    llm = LLM(model, max_num_seqs=1, block_size=16, max_model_len=max_len,
              num_blocks=-(-max_len // 16) + private_blocks(proposer), decode_path="static",
              gemv_rows=64, compile=True, spec_pipeline=1)
    llm.set_proposer(proposer)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, exit_policy="fixed"))
    program = llm.llm_engine._spec._tree._programs[1, False, True, False]
    cfg = model.config
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q_out = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    shapes = {"qkv (rope)": (q_out, h), "o": (cfg.num_attention_heads * cfg.head_dim, h),
              "gate_up": (2 * inter, h), "down": (h, inter)}

    def score() -> dict:
        times = {n: _ms(_rounds_graph(program, n), args.replays) for n in (16, 5)}
        return {"ms_16": times[16], "ms_5": times[5],
                "score": LEAD_SHARE * times[16] + (1 - LEAD_SHARE) * times[5]}

    result = {"before": score(), "shapes": {}}
    print("before", json.dumps(result["before"]), flush=True)
    for name, (n, k) in shapes.items():
        key = ("few_rows_fma", n, k)
        before = TILES.get(key)
        trials = []
        for tiles in _candidates(name.endswith("(rope)")):
            TILES[key] = tiles
            try:
                trials.append((score(), tiles))
            except Exception as exc:   # a tile the kernel refuses or Triton cannot build
                print(name, tiles, "failed:", repr(exc)[:200], flush=True)
        best_score, best = min(trials, key=lambda t: t[0]["score"])
        TILES[key] = best
        result["shapes"][name] = {"key": list(key), "before": before, "best": best,
                                  "best_score": best_score,
                                  "trials": [[list(t), s] for s, t in trials]}
        print(name, "before", before, "best", best, json.dumps(best_score), flush=True)
    result["after"] = score()
    print("after", json.dumps(result["after"]), flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
