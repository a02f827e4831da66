"""Tree proposers replayed on recorded greedy rollouts: the engine's tree path (issue 16,
rltlab.engine.spec.tree_graph) without the engine, to choose what to time on the GPU.

A greedy request's tokens do not depend on the proposer (verification is exact), and neither
do the heads' candidates at each position: they come from the final round's state of the token
before it. So one full-depth greedy rollout per prompt (eos ignored, as verification reads past
it) and the heads' ranks of the true tokens at every position determine every iteration of
any TreeProposer: which nodes it verifies, how many tokens it emits, whether the lookup chain's
rows run. `replay` walks them as TreeGraph.run does, and gives per request the engine's own
spec_stats (steps, emitted, drafted); tests compare the two on the CPU. The CLI adds, per
tree, two rows that are replay only:
  - " oracle first (bound)": the lookup chain verified exactly where it beats the heads, the
    most any adaptive rule could reach;
  - " agree first, decided one program late": the agreement rule as a host would apply it
    that launched each program before reading the last one back (rule="late").

The speed figure is a **cost model**, not a measurement: a program's cost is linear in its
rows between two costs fitted to one GPU's runs; target only costs a fixed time per token; both pay
the same prompt step per request (CostModel; one iteration a program).

    python -m rltlab.bench.tree_sim --prompts 32 --max-tokens 32 --lookup 10
    python -m rltlab.bench.tree_sim --prompts 16 --max-tokens 128 --lookup 16 --verify \
        --target-token-ms 0.321
    python -m rltlab.bench.tree_sim --split train --prompts 512
    python -m rltlab.bench.tree_sim --prompts-file my_prompts.json --model DIR --heads HEADS

Last line: JSON.
"""
from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rltlab.engine.spec.prompt_lookup import prompt_lookup_match
from rltlab.engine.tokenize import encode_prompt
from rltlab.engine.spec.tree_graph import TreeShape
from rltlab.model.checkpoint import load_model, model_hash

RANK_CAP = 64   # ranks at or past this are stored as the cap (no tree reaches that far)


@dataclass
class Rollout:
    prompt: list[int]
    tokens: list[int]        # the greedy continuation, max_tokens long (eos not stopping it)
    end: int                 # tokens the engine emits: through the first eos, else all
    ranks: list[list[int]]   # [i][k - 1]: rank of tokens[i + k] under head k at root i, or -1
    top1: list[list[int]]    # [i][k - 1]: head k's first candidate at root i


@torch.no_grad()
def record(model, heads, prompts: list[list[int]], max_tokens: int, eos: int | None,
           batch_size: int = 64) -> list[Rollout]:
    """Greedy full-depth rollouts and the heads' view of them. Root i is tokens[i]; the heads
    read it with the state that produced it, as the engine's tree program does."""
    from rltlab.draft_heads.lookahead_train import capture_rollouts
    param = next(model.parameters())
    out = []
    for prompt, (y, h) in zip(prompts, capture_rollouts(model, prompts, max_tokens, batch_size,
                                                        None)):
        logits = heads(h.to(param.device, param.dtype), y.to(param.device)).float().cpu()
        length, depth = len(y), heads.depth
        ranks = torch.full((length, depth), -1, dtype=torch.long)
        for k in range(1, min(depth, length - 1) + 1):
            scores = logits[:length - k, k - 1]
            true = scores.gather(-1, y[k:, None])
            ranks[:length - k, k - 1] = (scores > true).sum(-1).clamp(max=RANK_CAP)
        tokens = y.tolist()
        end = next((i + 1 for i, t in enumerate(tokens) if t == eos), len(tokens))
        out.append(Rollout(list(prompt), tokens, end, ranks.tolist(),
                           logits.argmax(-1).tolist()))
    return out


def recorded(model, heads, prompts: list[list[int]], max_tokens: int, eos: int | None,
             cache: str | None = None) -> list[Rollout]:
    """record(), or the rollouts `cache` holds for exactly these inputs (model and heads by
    their weights' hash, prompts, max_tokens, eos), so proposers can be replayed again without
    recording again (lookahead_train.cached_rollouts). A new recording is saved there
    (atomically); a cache recorded for other inputs is refused, untouched."""
    from rltlab.draft_heads.lookahead_train import cached_rollouts
    if cache is None:
        return record(model, heads, prompts, max_tokens, eos)
    settings = {"model": model_hash(model), "heads": model_hash(heads), "max_tokens": max_tokens,
                "eos": eos,
                "prompts": hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]}
    saved = cached_rollouts(cache, settings, lambda: [
        asdict(r) for r in record(model, heads, prompts, max_tokens, eos)], refuse_other=True)
    return [Rollout(**r) for r in saved]


@dataclass
class Iteration:
    rows: int           # rows the program computed (with or without the lookup chain's)
    verified: int       # nodes it verified (spec_stats.drafted)
    emitted: int        # tokens it emitted (spec_stats.emitted: accepted + 1)
    lookup: bool        # whether the lookup chain's rows ran


def replay(rollout: Rollout, proposer, max_tokens: int,
           rule: str | None = None) -> list[Iteration]:
    """The iterations TreeGraph.run takes for this request with this TreeProposer, one a
    program. Two rules are replay only, no engine's:
      - "oracle" verifies the lookup chain exactly where it accepts more than the heads' tree,
        and in a request's first iteration: the upper bound of any adaptive rule, which
        cannot know that in advance;
      - "late" decides the proposer's adaptive rule one program late, as a host that launched
        each program before reading the last one back would: program j >= 2 takes the
        decision made for program j - 1, and programs 0 and 1 verify the lookup chain (the
        host has read nothing back when it launches them)."""
    if rule not in (None, "oracle", "late"):
        raise ValueError(f"rule must be None, 'oracle' or 'late', got {rule!r}")
    shape = TreeShape(proposer.paths, "cpu", proposer.tree)
    tree, depth, span, lookup = set(proposer.tree), proposer.depth, proposer.span, \
        proposer.lookup
    heads_within = [sum(len(p) <= cap for p in proposer.tree) for cap in range(span + 1)]
    tokens, ranks, history = rollout.tokens, rollout.ranks, list(rollout.prompt)
    iterations, i, hit, decided = [], 0, True, True   # decided: the last program's decision
    while i + 1 < rollout.end:           # tokens[i] pending: tokens[:i + 1] are emitted
        history[len(rollout.prompt):] = tokens[:i + 1]
        fresh = i == 0
        valid = not fresh or proposer.first_drafts
        cap = min(span, max_tokens - (i + 1) - 1) if valid or lookup else 0
        drafts, matched = prompt_lookup_match(history, lookup, proposer.ngram) if lookup else \
            ([], 0)
        holds = bool(proposer.adaptive_lookup) and lookup > 0 and _rule_holds(
            proposer.lookup_rule, hit, drafts, matched, rollout.top1[i][0])
        if rule == "late":
            holds, decided = decided or len(iterations) < 2, holds
        use_lookup = lookup > 0 and (not proposer.adaptive_lookup or fresh or holds)
        n = 0
        if valid:                        # the deepest accepted node of the heads' tree
            while n < min(cap, depth) and tuple(ranks[i][:n + 1]) in tree:
                n += 1
        if lookup:
            m = 0
            while m < min(cap, lookup) and drafts[m] == tokens[i + 1 + m]:
                m += 1
            if rule == "oracle":
                use_lookup = fresh or m > n
            n = max(n, m) if use_lookup else n
            hit = drafts[0] == tokens[i + 1]   # the drafts began the tokens emitted
        iterations.append(Iteration(shape.num_rows if use_lookup else shape.heads_rows,
                                    heads_within[cap] * valid + min(lookup, cap) * use_lookup,
                                    n + 1, use_lookup))
        i += n + 1
    return iterations


def _rule_holds(rule: str, hit: bool, drafts: list[int], matched: int, heads_first: int
                ) -> bool:
    """TreeProposer's adaptive rule for the iteration at a root, as the iteration before
    decided it on the device: that one's hit, and this root's drafts, their match length and
    the heads' first candidate after it."""
    return hit if rule == "hits" else drafts[0] == heads_first or (hit and matched >= 2)


def spec_stats(iterations: list[Iteration]) -> dict:
    """The engine's spec_stats fields for these iterations."""
    return {"steps": len(iterations), "drafted": sum(it.verified for it in iterations),
            "emitted": sum(it.emitted for it in iterations)}


@dataclass
class CostModel:
    """A cost model of the engine at c = 1 on one GPU (fp32, the embedded model; not a
    measurement). A program costs program_at_5 ms with 5 rows and program_at_16 with 16 (its
    rounds, glue and host turn), linear between and beyond; a target-only token costs
    target_token ms with its host share; both sides pay prompt_step ms a request. The program
    costs were fitted to one measured run (32 x 32, chain K = 4 + lookup 10 always and adaptive,
    the shipped heads) and target_token to that run's target only, so they describe that
    machine only (docs/experiments/loop_speculation.md, "Replaying proposers without the
    engine"). target_token depends on the workload: 0.388 ms on 32 x 32, 0.321 on 16 x 128."""
    program_at_5: float = 0.542
    program_at_16: float = 0.637
    target_token: float = 0.388
    prompt_step: float = 1.2

    def program_ms(self, rows: int) -> float:
        return self.program_at_5 + (self.program_at_16 - self.program_at_5) * (rows - 5) / 11

    def tree_ms(self, per_request: list[list[Iteration]]) -> float:
        return len(per_request) * self.prompt_step + \
            sum(self.program_ms(it.rows) for its in per_request for it in its)

    def target_ms(self, rollouts: list[Rollout]) -> float:
        return len(rollouts) * self.prompt_step + \
            sum(r.end - 1 for r in rollouts) * self.target_token

    def ratio(self, per_request: list[list[Iteration]], rollouts: list[Rollout]) -> float:
        """Modelled target-only time over tree-path time for these requests."""
        return self.target_ms(rollouts) / self.tree_ms(per_request)


def summary(per_request: list[list[Iteration]], rollouts, cost: CostModel) -> dict:
    its = [it for request in per_request for it in request]
    return {"tau": sum(it.emitted for it in its) / len(its), "programs": len(its),
            "rows_per_program": sum(it.rows for it in its) / len(its),
            "lookup_share": sum(it.lookup for it in its) / len(its),
            "model_tree_ms": cost.tree_ms(per_request),
            "model_ratio": cost.ratio(per_request, rollouts)}


def proposers(heads, artifact_tree, lookup: int) -> dict:
    """The chain K = 4 and the artifact's tree, each with a lookup chain verified always,
    after hits and by the agreement rule, with and without first drafts."""
    from rltlab.engine import TreeProposer
    chain = [tuple([0] * j) for j in range(1, heads.depth + 1)]
    out = {}
    for name, tree in (("chain K=4", chain), (f"tree B={len(artifact_tree)}", artifact_tree)):
        for rule in (False, "hits", "agree"):
            for first in (False, True):
                label = f"{name} +lookup{lookup} {rule or 'always'}{' first' * first}"
                out[label] = TreeProposer(heads, tree, lookup=lookup, adaptive_lookup=rule,
                                          first_drafts=first)
    return out


def verify(model, proposer, rollouts: list[Rollout], max_tokens: int) -> int:
    """Requests whose replayed spec_stats and tokens equal the engine's (CPU, one at a time)."""
    from rltlab.engine import LLM, SamplingParams
    from rltlab.engine.spec.tree_graph import private_blocks
    max_len, block = max(len(r.prompt) for r in rollouts) + max_tokens + 1, max(16, proposer.span)
    llm = LLM(model, max_num_seqs=1, block_size=block, max_model_len=max_len,
              num_blocks=-(-max_len // block) + private_blocks(proposer), decode_path="static")
    llm.set_proposer(proposer)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, exit_policy="fixed")
    outs = llm.generate([r.prompt for r in rollouts], params)
    same = 0
    for out, rollout in zip(outs, rollouts):
        engine = {k: out.spec_stats[k] for k in ("steps", "drafted", "emitted")}
        same += engine == spec_stats(replay(rollout, proposer, max_tokens)) and \
            list(out.outputs[0].token_ids) == rollout.tokens[:rollout.end]
    return same


def file_prompts(path: str, tokenizer, vocab_size: int, limit: int) -> list[list[int]]:
    """The first `limit` prompts of a JSON list: each a text (encoded with the tokenizer's
    special tokens, rltlab.engine.tokenize) or a list of token ids. Refused, naming the item,
    where an item is neither, is empty or holds an id outside the vocabulary."""
    try:
        items = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"--prompts-file {path}: not a readable JSON file ({err})") from err
    if not isinstance(items, list) or not items:
        raise ValueError(f"--prompts-file {path}: expected a non-empty JSON list of prompts")
    prompts = []
    for i, item in enumerate(items[:limit]):
        if isinstance(item, str):
            ids = encode_prompt(tokenizer, item)
        elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                            for t in item):
            ids = item
        else:
            raise ValueError(f"--prompts-file {path}: prompt {i} is neither a text nor a list "
                             f"of token ids")
        if not ids or not all(0 <= t < vocab_size for t in ids):
            raise ValueError(f"--prompts-file {path}: prompt {i} is empty or holds an id "
                             f"outside the vocabulary (0..{vocab_size - 1})")
        prompts.append(ids)
    return prompts


def main(argv=None) -> dict:
    from rltlab.bench.tree_spec import HEADS
    ap = argparse.ArgumentParser(prog="python -m rltlab.bench.tree_sim",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None,
                    help="checkpoint directory (default: the embedded model); --heads must have "
                         "been trained for it")
    ap.add_argument("--heads", default=HEADS)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--lookup", type=int, default=10)
    ap.add_argument("--split", choices=["eval", "train"], default="eval",
                    help="eval: the held-out prompts the GPU benches run (half arithmetic, half "
                         "text); train: TRAINING-split prompts (rollout_data.training_prompts, "
                         "--seed), where a rule is chosen before it meets the held-out ones")
    ap.add_argument("--seed", type=int, default=7, help="--split train's prompt seed")
    ap.add_argument("--prompts-file", default=None, metavar="JSON",
                    help="replay these prompts instead of --split's: a JSON list of texts or "
                         "token-id lists (the first --prompts of them)")
    ap.add_argument("--target-token-ms", type=float, default=CostModel.target_token,
                    help="the cost model's target-only token in ms (CostModel: 0.388 fits "
                         "32 x 32, 0.321 fits 16 x 128)")
    ap.add_argument("--cache", default=None, metavar="FILE",
                    help="the recorded rollouts: reused where the model, heads, prompts and "
                         "--max-tokens match, refused where they do not, written after a new "
                         "recording")
    ap.add_argument("--verify", action="store_true",
                    help="also run every proposer through the engine (CPU) and count the "
                         "requests whose spec_stats and tokens the replay reproduced")
    args = ap.parse_args(argv)
    if min(args.prompts, args.max_tokens, args.lookup) < 1 or args.target_token_ms <= 0:
        ap.error("--prompts, --max-tokens and --lookup must be >= 1, --target-token-ms > 0")
    from rltlab.draft_heads import lookahead
    from rltlab.draft_heads.evaluate import eval_prompts
    model, tok, model_dir = load_model(args.model, dtype="float32", device="cpu")
    heads, artifact_tree, _ = lookahead.load(args.heads, model)
    if args.prompts_file:
        try:
            prompts = file_prompts(args.prompts_file, tok, model.config.vocab_size, args.prompts)
        except ValueError as err:
            ap.error(str(err))
        if len(prompts) < args.prompts:   # the JSON's "prompts" says so too
            print(f"{args.prompts_file} holds {len(prompts)} prompts: using them all, not "
                  f"--prompts {args.prompts}", flush=True)
    elif args.split == "eval":
        prompts = eval_prompts(tok, model_dir, args.prompts)
    else:
        from rltlab.draft_heads.rollout_data import training_prompts
        prompts = [p for p, _ in training_prompts(tok, args.prompts - args.prompts // 2,
                                                  args.prompts // 2, 24, args.seed)]
    try:
        rollouts = recorded(model, heads, prompts, args.max_tokens, model.config.eos_token_id,
                            args.cache)
    except ValueError as err:
        ap.error(str(err))
    cost = CostModel(target_token=args.target_token_ms)
    result = {"prompts": len(prompts), "max_tokens": args.max_tokens,
              "split": f"file {args.prompts_file}" if args.prompts_file else args.split,
              "seed": args.seed if args.split == "train" and not args.prompts_file else None,
              "model": args.model or "embedded", "heads": args.heads,
              "lookup": args.lookup, "cost_model": asdict(cost), "configs": {}}
    configs = {name: (proposer, None)
               for name, proposer in proposers(heads, artifact_tree, args.lookup).items()}
    for name, (proposer, _) in list(configs.items()):
        if name.endswith(" hits first"):   # the bound of any adaptive rule
            configs[name.replace(" hits first", " oracle first (bound)")] = (proposer, "oracle")
        if name.endswith(" agree first"):  # what launching one program ahead costs the rule
            configs[name + ", decided one program late"] = (proposer, "late")
    for name, (proposer, rule) in configs.items():
        row = summary([replay(r, proposer, args.max_tokens, rule=rule) for r in rollouts],
                      rollouts, cost)
        if args.verify and rule is None:
            row["engine_matches"] = verify(model, proposer, rollouts, args.max_tokens)
        result["configs"][name] = row
        print(f"{name:>40}: tau {row['tau']:.2f}, {row['rows_per_program']:4.1f} rows a "
                   f"program, lookup {row['lookup_share']:.2f}, cost model "
                   f"{row['model_ratio']:.3f}x" + (f", engine matches {row['engine_matches']}/"
                                                  f"{len(rollouts)}" if rule is None and
                                                  args.verify else ""),
              flush=True)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    from rltlab.common.command import run_command

    run_command(main)
