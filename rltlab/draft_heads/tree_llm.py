"""An engine that decodes a lone greedy request with tree speculation, set up in one call as
the fastest configuration measured (issue 16; docs/experiments/loop_speculation.md):

    from rltlab.draft_heads.tree_llm import tree_llm
    llm = tree_llm(model, max_model_len=512)          # the model's shipped lookahead heads
    out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=128,
                                               exit_policy="fixed"))

It is the same LLM and TreeProposer one can build by hand (docs/engine.md section 7.2), with:
  - the heads' rank-0 chain (K = their depth) and a prompt-lookup chain of FASTEST["lookup"]
    nodes verified by agreement, first drafts on: the fastest proposer measured on every
    workload tried;
  - one sequence at a time (max_num_seqs=1: the engine speculates while exactly one greedy
    full-depth sequence runs, and steps normally otherwise), each request's first program
    launched behind its prompt step (launch_behind_prompt); what this configuration gains
    over target-only decoding, and on what: docs/results.md S1 and S5;
  - the KV pool sized for one max_model_len sequence plus the tree's private blocks;
  - the static decode path, and on CUDA the settings those figures were measured with
    (compile=True, gemv_rows=64).
Any EngineConfig field passed as a keyword overrides these.
"""
from __future__ import annotations

from pathlib import Path

FASTEST = {"lookup": 10, "adaptive_lookup": "agree", "first_drafts": True}
CUDA_SETTINGS = {"compile": True, "gemv_rows": 64}   # as measured (docs/results.md S1)


def tree_llm(model, heads=None, *, max_model_len: int, block_size: int = 16,
             proposer: dict | None = None, **engine_kwargs):
    """-> rltlab.engine.LLM with the TreeProposer set (module docstring). heads: a directory
    of saved lookahead heads trained for this model (default: the embedded model's shipped
    lookahead_h4; a model they were not trained for is refused by their hash); proposer:
    TreeProposer arguments over FASTEST (e.g. {"lookup": 0}), "tree" among them (default: the
    rank-0 chain); lookup 0 (no lookup chain) also turns FASTEST's adaptive_lookup off unless
    it is given."""
    from rltlab.draft_heads.lookahead import load
    from rltlab.draft_heads.selfdistill import draft_heads_dir
    from rltlab.engine import LLM, TreeProposer
    from rltlab.engine.spec.tree_graph import private_blocks
    if not callable(getattr(model, "parameters", None)):
        raise TypeError(f"tree_llm needs the loaded model (rltlab.model.checkpoint.load_model), "
                        f"got {type(model).__name__}")
    if not isinstance(max_model_len, int) or isinstance(max_model_len, bool) or \
            max_model_len < 2:
        raise ValueError(f"max_model_len must be an int >= 2 (a prompt token and an output), "
                         f"got {max_model_len!r}")
    options = {**FASTEST, **(proposer or {})}
    if options.get("lookup") == 0 and "adaptive_lookup" not in (proposer or {}):
        options["adaptive_lookup"] = False   # no lookup chain: FASTEST's rule has none to adapt
    unknown = set(options) - {"tree", "lookup", "ngram", "adaptive_lookup", "first_drafts"}
    if unknown:
        raise ValueError(f"proposer: unknown TreeProposer arguments {sorted(unknown)}")
    path = Path(heads) if heads is not None else draft_heads_dir() / "lookahead_h4"
    drafter, _, _ = load(path, model)
    tree = options.pop("tree", None) or [(0,) * j for j in range(1, drafter.depth + 1)]
    tree_proposer = TreeProposer(drafter, tree, **options)
    settings = {"max_num_seqs": 1, "block_size": block_size, "max_model_len": max_model_len,
                "num_blocks": -(-max_model_len // block_size) + private_blocks(tree_proposer),
                "decode_path": "static", "launch_behind_prompt": True,
                **(CUDA_SETTINGS if next(model.parameters()).is_cuda else {}),
                **engine_kwargs}
    llm = LLM(model, **settings)
    llm.set_proposer(tree_proposer)
    return llm
