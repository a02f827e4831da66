"""LLMEngine.step taking the next prompt's step at once where a step ends the last running
request ("chained", the engine's behaviour since this session) against one step a call with
the outputs built at the finish ("unchained", the engine before it), paired in one process,
on the claim's workload: the held-out prompts, 32 new tokens, c = 1, greedy, fixed depth R.

Engines (as python -m rltlab.bench.tree_spec builds them): the four target-only rows (plain,
compiled, early, compiled early) and the claimed tree config (chain K = 4 + lookup 10 by
agreement, first drafts, launched behind the prompt, compiled, gemv_rows 64). Every engine
runs in both modes each repeat, interleaved, the order rotating.

    python docs/experiments/scripts/chained_step_ab.py --device cuda --repeats 15

Per engine: chained over unchained (paired per repeat: median, mean ± SE). The claim in each
mode: the tree against the fastest target-only row of that mode (by median), paired per
repeat. Every row's tokens must equal target only's. Last line: JSON.
"""
import argparse
import json
import statistics
import time
from functools import partial

import torch
from tqdm.auto import tqdm

from rltlab.bench.tree_spec import HEADS, PIPELINE, _engine_configs, _paired, _sync
from rltlab.common.device import add_device_argument
from rltlab.draft_heads import lookahead
from rltlab.draft_heads.evaluate import eval_prompts
from rltlab.engine import LLM, SamplingParams
from rltlab.engine.llm_engine import LLMEngine
from rltlab.model.checkpoint import load_model

CHAINED = [True]
_step = LLMEngine.step


def _step_by_mode(self):
    if CHAINED[0]:
        return _step(self)
    self._step_once()           # the engine before: one step a call
    return self._drain_outputs()


def main():
    ap = argparse.ArgumentParser()
    add_device_argument(ap)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    LLMEngine.step = _step_by_mode
    model, tok, md = load_model(None, dtype="float32", device=args.device)
    model.eval()
    heads, _, _ = lookahead.load(HEADS, model)
    prompts = eval_prompts(tok, md, args.prompts)
    max_len = max(map(len, prompts)) + args.max_tokens + 1
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, exit_policy="fixed")

    def target_only(**config):
        llm = LLM(model, max_num_seqs=1, block_size=16, kv_cache_memory_gib=0.5,
                  max_model_len=max_len, **config)
        return lambda: [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    configs = {"target only": target_only(),
               "target only compiled": target_only(compile=True),
               "target only early": target_only(launch_behind_prompt=True),
               "target only compiled early": target_only(compile=True,
                                                         launch_behind_prompt=True)}
    tree_args = argparse.Namespace(
        engine_compile=[True], chains=[1], pipelines=[PIPELINE], gemv_rows=[64],
        launch_early=True, device_loop=False, lookup=[10], adaptive_lookup=["agree"],
        first_drafts=True, ngram=3)
    trees = {"chain K=4": [tuple([0] * j) for j in range(1, 5)]}
    engines = _engine_configs(tree_args, model, trees, {"": heads}, max_len, params)
    name = "engine chain K=4 +lookup10 agree first M=1 compiled gemv<=64 early"
    configs["tree"] = partial(engines[name], prompts)
    runs = [(config, mode) for config in configs for mode in (True, False)]
    for config, mode in tqdm(runs, desc="warm-up", unit="run"):
        CHAINED[0] = mode
        configs[config]()
    seconds = {run: [] for run in runs}
    tokens = {}
    for rep in tqdm(range(args.repeats), desc="repeats", unit="repeat"):
        for config, mode in runs[rep % len(runs):] + runs[:rep % len(runs)]:
            CHAINED[0] = mode
            _sync(args.device)
            started = time.perf_counter()
            tokens[config, mode] = configs[config]()
            _sync(args.device)
            seconds[config, mode].append(time.perf_counter() - started)
    base = tokens["target only", True]
    rows = {}
    for config in configs:
        rows[config] = {
            "chained_over_unchained": _paired(seconds[config, False], seconds[config, True]),
            "median_s": {m: statistics.median(seconds[config, mode])
                         for m, mode in (("chained", True), ("unchained", False))},
            "identical": all(tokens[config, mode] == base for mode in (True, False))}
        print(f"{config:>28}: chained over unchained "
              f"{rows[config]['chained_over_unchained']['median']:.3f}, identical "
              f"{rows[config]['identical']}", flush=True)
    claim = {}
    for label, mode in (("chained", True), ("unchained", False)):
        fastest = min((c for c in configs if c != "tree"),
                      key=lambda c: statistics.median(seconds[c, mode]))
        claim[label] = {"fastest_target_only": fastest,
                        **_paired(seconds[fastest, mode], seconds["tree", mode])}
        print(f"claim, {label}: {claim[label]['median']:.3f} "
              f"({claim[label]['mean']:.3f} ± {claim[label]['se']:.3f}) vs {fastest}",
              flush=True)
    print(json.dumps({"device": torch.cuda.get_device_name() if args.device == "cuda" else
                      args.device, "repeats": args.repeats, "rows": rows, "claim": claim,
                      "seconds": {f"{c} | {'chained' if m else 'unchained'}": s
                                  for (c, m), s in seconds.items()}}))


if __name__ == "__main__":
    main()
