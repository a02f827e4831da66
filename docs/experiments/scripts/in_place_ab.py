"""The tree's first leaf writing its K/V in place (a program of the first leaf's rows alone
copies no prefix block and commits nothing), against the same engine with every program
copying and committing as before (TreeProgram.in_place forced off: the prefix block copied
into the other leaves' private blocks and the commit run, in every program), paired in one
process on the claim's workload: the held-out prompts, 32 new tokens, c = 1, greedy, fixed
depth R.

Engines (as python -m rltlab.bench.tree_spec builds them): the four target-only rows (plain,
compiled, early, compiled early) and the claimed tree config (chain K = 4 + lookup 10 by
agreement, first drafts, launched behind the prompt, compiled, gemv_rows 64) twice: "in
place" and "copies". Every config runs each repeat, interleaved, the order rotating.

    python docs/experiments/scripts/in_place_ab.py --device cuda --repeats 15

Prints in place over copies (paired per repeat: median, mean ± SE), and the claim for each:
the tree against the fastest target-only row, repeat by repeat (as the bench's vs_faster).
Every row's tokens must equal target only's. Last line: JSON.
"""
import argparse
import json
import statistics
from functools import partial

import torch
from tqdm.auto import tqdm

from rltlab.bench.tree_spec import FASTER, HEADS, _paired, interleaved
from rltlab.common.device import add_device_argument
from rltlab.draft_heads import lookahead
from rltlab.draft_heads.evaluate import eval_prompts
from rltlab.engine import LLM, SamplingParams, TreeProposer
from rltlab.engine.tree_graph import private_blocks
from rltlab.engine.tree_program import TreeProgram
from rltlab.model.checkpoint import load_model

_init = TreeProgram.__init__


def _init_maybe_copying(self, tree, *args, **kwargs):
    _init(self, tree, *args, **kwargs)
    if getattr(tree, "force_copies", False):
        self.in_place = False


def main():
    ap = argparse.ArgumentParser()
    add_device_argument(ap)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    TreeProgram.__init__ = _init_maybe_copying
    model, tok, md = load_model(None, dtype="float32", device=args.device)
    model.eval()
    heads, _, _ = lookahead.load(HEADS, model)
    prompts = eval_prompts(tok, md, args.prompts)
    max_len = max(map(len, prompts)) + args.max_tokens + 1
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, exit_policy="fixed")

    def generate(llm):
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]

    def target_only(**config):
        return partial(generate, LLM(model, max_num_seqs=1, block_size=16,
                                     kv_cache_memory_gib=0.5, max_model_len=max_len, **config))

    def tree(force_copies: bool):
        proposer = TreeProposer(heads, [tuple([0] * j) for j in range(1, 5)], lookup=10,
                                adaptive_lookup="agree", first_drafts=True)
        llm = LLM(model, max_num_seqs=1, block_size=16, max_model_len=max_len,
                  num_blocks=-(-max_len // 16) + private_blocks(proposer), decode_path="static",
                  compile=True, gemv_rows=64, launch_behind_prompt=True)
        llm.set_proposer(proposer)
        llm.llm_engine.spec_graphs[id(proposer)].force_copies = force_copies
        return partial(generate, llm)
    configs = {"target only": target_only(), "target only compiled": target_only(compile=True),
               "target only early": target_only(launch_behind_prompt=True),
               "target only compiled early": target_only(compile=True,
                                                         launch_behind_prompt=True),
               "tree in place": tree(False), "tree copies": tree(True)}
    assert set(FASTER) <= set(configs), FASTER
    for fn in tqdm(list(configs.values()), desc="warm-up", unit="config"):
        fn()
    seconds = {name: [] for name in configs}
    tokens = {}
    for name, result, elapsed in interleaved(configs, args.repeats, args.device):
        tokens[name] = result
        seconds[name].append(elapsed)
    identical = {name: tokens[name] == tokens["target only"] for name in configs}
    fastest = list(map(min, *(seconds[b] for b in FASTER)))
    claim = {name: _paired(fastest, seconds[name]) for name in ("tree in place", "tree copies")}
    in_place = _paired(seconds["tree copies"], seconds["tree in place"])
    for name, c in claim.items():
        print(f"claim, {name}: {c['median']:.3f} ({c['mean']:.3f} ± {c['se']:.3f})")
    print(f"in place over copies: {in_place['median']:.4f} ({in_place['mean']:.4f} ± "
          f"{in_place['se']:.4f}); identical {identical}")
    print(json.dumps({"device": torch.cuda.get_device_name() if args.device == "cuda" else
                      args.device, "repeats": args.repeats, "identical": identical,
                      "in_place_over_copies": in_place, "claim": claim,
                      "median_s": {n: statistics.median(s) for n, s in seconds.items()},
                      "seconds": seconds}))


if __name__ == "__main__":
    main()
