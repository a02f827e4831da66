"""The workbench's rollouts stop where the model's config says (eos_token_id), not at the embedded
model's end-of-text id 0: a model whose eos is another id generates token 0 as ordinary text."""
from types import SimpleNamespace

import torch

from tiny_models import random_prompts, tiny_engine_model

torch.set_num_threads(1)

EOS = 59


def _model_that_writes_token_0():
    """tiny_engine_model with eos 59 and tokens 0 and 56 swapped (embedding and head), so greedy
    decoding writes 0 wherever it wrote 56."""
    model = tiny_engine_model(0)
    model.config.eos_token_id = EOS
    with torch.no_grad():
        for weight in {id(p): p for p in (model.lm_head.weight,
                                          model.model.embed_tokens.weight)}.values():
            weight[[0, 56]] = weight[[56, 0]]
    return model


def test_workbench_params_stop_at_the_models_eos_only():
    from rltlab.engine import LLM
    from rltlab.loop.addons import _engine_params
    from rltlab.loop.deploy import _params
    from rltlab.traces.rollout import rollout_params

    llm = LLM(_model_that_writes_token_0())
    prompts = random_prompts(16, seed=5, min_len=3, max_len=9)
    state = SimpleNamespace(cfg=SimpleNamespace(temperature=0.0, min_loops=1, tasks="embedded"))
    builders = {"traces.rollout_params": rollout_params(1.0, 24),
                "loop.deploy (Q-exit)": _params(state, None, 24, 0, threshold=1.0),
                "loop.deploy (policy)": _params(state, "q_exit", 24, 0),
                "loop.addons": _engine_params("q_exit", {}, 24)}
    for name, params in builders.items():
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        for o in outs:
            assert o.finish_reason == "length" or o.token_ids[-1] == EOS, \
                f"{name}: stopped at {o.token_ids[-1]} ({o.token_ids}), the model's eos is {EOS}"
        assert any(0 in o.token_ids[:-1] for o in outs), \
            f"{name}: no output writes token 0 before its end (the check is void)"
