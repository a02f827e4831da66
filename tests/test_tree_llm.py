"""tree_llm: one call builds the engine with the fastest proposer measured; it decodes the
target's own greedy tokens, speculating, and refuses bad input before building anything."""
import pytest
import torch

from rltlab.draft_heads.tree_llm import FASTEST, tree_llm
from rltlab.engine import LLM, SamplingParams, TreeProposer
from rltlab.model.checkpoint import load_model

torch.set_num_threads(1)
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, exit_policy="fixed")


@pytest.fixture(scope="module")
def embedded():
    from rltlab.draft_heads.evaluate import eval_prompts
    model, tok, model_dir = load_model(None, dtype="float32", device="cpu")
    return model, eval_prompts(tok, model_dir, 4)


def test_the_shipped_heads_decode_the_targets_tokens_speculating(embedded):
    model, prompts = embedded
    max_len = max(map(len, prompts)) + PARAMS.max_tokens + 1
    llm = tree_llm(model, max_model_len=max_len)
    proposer = llm.llm_engine.proposer
    assert isinstance(proposer, TreeProposer)
    assert (proposer.lookup, proposer.lookup_rule, proposer.first_drafts) == (10, "agree", True)
    assert proposer.tree == [(0,) * j for j in range(1, proposer.depth + 1)]
    assert llm.llm_engine.config.max_num_seqs == 1 and llm.llm_engine.config.execution.launch_behind_prompt
    outs = llm.generate(prompts, PARAMS)
    plain = LLM(model, max_num_seqs=1, max_model_len=max_len).generate(prompts, PARAMS)
    assert [list(o.outputs[0].token_ids) for o in outs] == \
        [list(o.outputs[0].token_ids) for o in plain]
    stats = [o.spec_stats for o in outs]
    assert all(s and s["steps"] > 0 for s in stats)
    # the heads and the lookup chain draft: more than one token a verification on average
    assert sum(s["emitted"] for s in stats) > 1.5 * sum(s["steps"] for s in stats)


def test_proposer_and_engine_settings_can_be_overridden(embedded):
    model, _ = embedded
    llm = tree_llm(model, max_model_len=64, block_size=32,
                   proposer={"lookup": 0, "adaptive_lookup": False, "first_drafts": False},
                   kv_cache_memory_gib=0.25, launch_behind_prompt=False)
    proposer = llm.llm_engine.proposer
    assert llm.llm_engine.config.execution.launch_behind_prompt is False
    assert (proposer.lookup, proposer.lookup_rule, proposer.first_drafts) == (0, None, False)
    assert llm.llm_engine.config.block_size == 32
    assert FASTEST["lookup"] == 10   # the defaults were not mutated by the override


def test_the_docstrings_proposer_example_runs(embedded):
    """tree_llm's own docstring example, proposer={"lookup": 0}, tripped on FASTEST's
    adaptive_lookup="agree" (no lookup chain to adapt), a default the caller never set."""
    import ast
    import re
    model, prompts = embedded
    example = ast.literal_eval(re.search(r"\(e\.g\. (\{.*?\})\)", tree_llm.__doc__).group(1))
    assert example == {"lookup": 0}
    max_len = len(prompts[0]) + 7
    llm = tree_llm(model, max_model_len=max_len, proposer=example)
    proposer = llm.llm_engine.proposer
    assert (proposer.lookup, proposer.lookup_rule, proposer.first_drafts) == (0, None, True)
    params = SamplingParams(temperature=0.0, max_tokens=6, exit_policy="fixed")
    out = llm.generate(prompts[:1], params)[0]
    plain = LLM(model, max_num_seqs=1, max_model_len=max_len).generate(prompts[:1], params)[0]
    assert list(out.outputs[0].token_ids) == list(plain.outputs[0].token_ids)
    # asked for explicitly, adaptive lookup without a chain is still refused
    with pytest.raises(ValueError, match="adaptive_lookup needs a lookup chain"):
        tree_llm(model, max_model_len=max_len, proposer={"lookup": 0, "adaptive_lookup": "agree"})


def test_bad_input_is_refused(embedded, tmp_path):
    model, _ = embedded
    with pytest.raises(ValueError, match="max_model_len must be an int >= 2"):
        tree_llm(model, max_model_len=1)
    with pytest.raises(ValueError, match=r"unknown TreeProposer arguments \['lookahead'\]"):
        tree_llm(model, max_model_len=64, proposer={"lookahead": 3})
    with pytest.raises(FileNotFoundError, match="holds no lookahead heads"):
        tree_llm(model, tmp_path, max_model_len=64)
    with pytest.raises(TypeError, match="needs the loaded model"):
        tree_llm("artifacts/ouro-tiny", max_model_len=64)
    other = load_model(None, dtype="float32", device="cpu")[0]
    with torch.no_grad():
        other.lm_head.weight.mul_(1.5)
    with pytest.raises(ValueError, match="was trained for model"):
        tree_llm(other, max_model_len=64)
