"""The engine's speculative path (LLMEngine.set_proposer, rltlab.engine.spec.decoder) is lossless:
token-identical to full-depth engine decoding at T=0, the target distribution at T=1, no leaked
KV blocks, consistent per-request stats."""
import pytest
import torch

from rltlab.model.config import OuroConfig
from rltlab.draft_heads.heads import build_component, save_component
from rltlab.engine import LLM, DraftProposer, SamplingParams
from rltlab.engine_patches.loop_draft import load_proposer
from rltlab.model.architecture import OuroForCausalLM
from test_speculative import _exact_joint, chisquare_pvalue
from tiny_models import tiny_engine_model

torch.set_num_threads(1)
R = 4


@pytest.fixture(scope="module")
def model():
    return tiny_engine_model(3)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, 61, (n,), generator=g).tolist() for n in (3, 9, 5, 1, 14, 6)]


def _params(i, temperature=0.0, **kw):
    return SamplingParams(temperature=temperature, max_tokens=6 + (i * 5) % 9, logprobs=0,
                          seed=i, ignore_eos=i % 2 == 0, **kw)


def _random_head(hidden, vocab, seed):
    head = torch.nn.Linear(hidden, vocab, bias=False)
    torch.nn.init.normal_(head.weight, std=0.5, generator=torch.Generator().manual_seed(seed))
    return head


def _residual_head(model, d):
    comp = build_component("residual_mlp", model, draft_rounds=d, inner=16)
    with torch.no_grad():   # an "imperfectly trained" head: not the shallow drafter
        comp.down.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(d))
    return comp.eval()


def _vocab5_engine(path: str, **engine_kw):
    """(model, engine) for the sampling-distribution tests: a vocab-5 model whose full-depth
    joint over a few tokens can be enumerated, and an engine that runs thousands of samples of
    one prompt at once."""
    cfg = OuroConfig(vocab_size=5, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, total_ut_steps=R,
                     max_position_embeddings=64)
    model = OuroForCausalLM(cfg).init_weights(3, std=0.6).eval()
    return model, LLM(model, block_size=4, max_num_seqs=512, max_num_batched_tokens=4096,
                      decode_path=path, **engine_kw)


class _NotReuseExact(torch.nn.Module):   # like draft_heads.LayerLoraDrafter
    reuse_exact = False


def _same(outs, refs):
    for out, ref in zip(outs, refs):
        assert out.token_ids == ref.token_ids
        assert out.exit_depths == ref.exit_depths == [R] * len(ref.token_ids)
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref.logprobs)) < 1e-5


def _check_stats(outs, k):
    for out in outs:
        s = out.spec_stats
        assert s is not None and s["steps"] >= 1
        assert 0 <= s["accepted"] <= s["drafted"] <= k * s["steps"]
        assert s["emitted"] == s["accepted"] + s["steps"]
        assert s["spec_tokens"] <= s["emitted"]
        assert s["tau"] == pytest.approx(1 + s["accepted"] / s["steps"])
        assert len(out.token_ids) == 1 + s["spec_tokens"]   # token 0 comes from the prefill


@pytest.mark.parametrize("d,k,conc,head", [(1, 4, 6, None), (1, 3, 1, "random"),
                                           (2, 2, 6, "residual"), (2, 5, 2, None),
                                           (3, 1, 6, "random")])
def test_greedy_identical_to_full_depth_engine(model, prompts, d, k, conc, head):
    params = [_params(i, exit_policy="fixed") if i % 3 else _params(i)
              for i in range(len(prompts))]
    refs = LLM(model, block_size=4, max_num_seqs=conc).generate(prompts, params)
    drafter = {"random": _random_head(32, 61, d), "residual": _residual_head(model, d),
               None: None}[head]
    llm = LLM(model, block_size=4, max_num_seqs=conc)
    llm.set_proposer(DraftProposer(k, d, drafter))
    outs = llm.generate(prompts, params)
    _same(outs, refs)
    if conc == len(prompts):    # every decode step was speculative
        _check_stats(outs, k)
    if head != "random":        # a random head may never be right; the model's own rounds are
        assert any(o.spec_stats and o.spec_stats["accepted"] for o in outs)
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.owner


def test_trained_component_from_disk_and_ineligible_requests(model, prompts, tmp_path):
    comp = _residual_head(model, 1)
    save_component(comp, model, tmp_path / "head")
    llm = LLM(model, block_size=8)
    llm.set_proposer(load_proposer(tmp_path / "head", model, num_draft_tokens=3))
    # A request that exits early (fixed depth 2) is not a full-depth target: the engine steps
    # normally while it runs, and results equal the engine without a proposer.
    params = [_params(i) for i in range(3)] + [_params(3, exit_policy="fixed",
                                                       exit_policy_args={"depth": 2})]
    refs = LLM(model, block_size=8).generate(prompts[:4], params)
    outs = llm.generate(prompts[:4], params)
    for out, ref in zip(outs, refs):
        assert out.token_ids == ref.token_ids and out.exit_depths == ref.exit_depths
    assert outs[3].spec_stats is None
    assert outs[3].exit_depths[1:] == [2] * (len(refs[3].token_ids) - 1)
    outs = llm.generate(prompts[:3], params[:3])   # alone: speculative again
    _same(outs, refs[:3])
    _check_stats(outs, 3)


def test_no_block_leaks_with_aborts_waiting_and_stops(model):
    g = torch.Generator().manual_seed(11)
    llm = LLM(model, block_size=4, num_blocks=24, max_num_seqs=4)
    llm.set_proposer(DraftProposer(4, 1))
    engine, finished, aborted = llm.llm_engine, 0, 0
    for i in range(40):
        n = int(torch.randint(1, 12, (), generator=g))
        prompt = torch.randint(1, 61, (n,), generator=g).tolist()
        engine.add_request(f"r{i}", prompt, SamplingParams(
            temperature=float(i % 2), seed=i, max_tokens=int(torch.randint(1, 14, (), generator=g)),
            stop_token_ids=[7] if i % 5 == 0 else [], n=1 + (i % 7 == 0)))
        for _ in range(3):
            finished += sum(o.finished for o in engine.step())
        if i % 6 == 3:
            aborted += engine.abort_request(f"r{i - 1}")
    while engine.has_unfinished_requests():
        finished += sum(o.finished for o in engine.step())
    assert finished == 40 and aborted > 0
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.owner
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_seeded_sampling_is_reproducible(model, prompts):
    params = [_params(i, temperature=1.0, top_k=20, top_p=0.9) for i in range(len(prompts))]
    runs = []
    for _ in range(2):
        llm = LLM(model, block_size=4)
        llm.set_proposer(DraftProposer(3, 2, _random_head(32, 61, 0)))
        runs.append([o.token_ids for o in llm.generate(prompts, params)])
    assert runs[0] == runs[1]


def test_rejects_bad_proposers(model):
    llm = LLM(model)
    with pytest.raises(TypeError):
        llm.set_proposer(object())
    with pytest.raises(ValueError):
        llm.set_proposer(DraftProposer(4, R))
    with pytest.raises(ValueError):
        DraftProposer(0, 1)
    with pytest.raises(ValueError):
        DraftProposer(2, 1, _NotReuseExact())
    llm.set_proposer(None)
    assert llm.llm_engine.proposer is None


@pytest.mark.parametrize("d,k,with_head,path", [(1, 2, False, "gather"), (2, 2, True, "gather"),
                                                (1, 2, False, "static"), (2, 2, True, "static")])
@pytest.mark.slow
def test_sampling_matches_target_distribution(d, k, with_head, path):
    """path "static": the iteration runs as one device program (rltlab.engine.spec.draft_program),
    drafts, acceptance tests and residual draws on the device."""
    vocab, n = 5, 3000
    model, llm = _vocab5_engine(path)
    prompt = [1, 3, 2]
    llm.set_proposer(DraftProposer(k, d, _random_head(16, vocab, 1) if with_head else None))
    outs = llm.generate([prompt], SamplingParams(n=n, temperature=1.0, seed=7, max_tokens=4,
                                                 ignore_eos=True))[0].outputs
    stats = [o.spec_stats for o in outs]
    assert 0 < sum(s["accepted"] for s in stats) < sum(s["drafted"] for s in stats)
    joint = _exact_joint(model, prompt, vocab, 1.0)
    seqs = torch.tensor([o.token_ids[:3] for o in outs])
    observed = torch.bincount(seqs[:, 1] * vocab + seqs[:, 2], minlength=vocab ** 2).double()
    expected = joint.sum(0).reshape(-1) * n
    pvalue = chisquare_pvalue(observed, expected)
    tv = 0.5 * (observed / n - expected / n).abs().sum()
    assert pvalue > 1e-3 and tv < 0.06, (pvalue, tv)
    observed0 = torch.bincount(seqs[:, 0], minlength=vocab).double()
    assert chisquare_pvalue(observed0, joint.sum((1, 2)) * n) > 1e-3


def test_greedy_identical_on_static_decode_path(model, prompts):
    """Draft passes are 1-token decode spans: the runner's static (CUDA-graph on GPU) path
    takes them; verification spans take the gather path."""
    params = [_params(i) for i in range(len(prompts))]
    refs = LLM(model, block_size=4).generate(prompts, params)
    llm = LLM(model, block_size=4, decode_path="static")
    llm.set_proposer(DraftProposer(3, 2))
    outs = llm.generate(prompts, params)
    _same(outs, refs)
    _check_stats(outs, 3)


def test_shipped_draft_components_are_lossless_in_the_engine():
    """The components shipped under artifacts/ouro-tiny/draft_heads (load_proposer, the path
    `python -m rltlab.bench.spec` uses) leave greedy engine outputs unchanged and draft."""
    from rltlab import workbench as W
    from rltlab.draft_heads.evaluate import eval_prompts
    from rltlab.draft_heads.selfdistill import shipped_components
    emb, tok, model_dir = W.load_model(None)
    ps = eval_prompts(tok, model_dir, 4)
    sp = SamplingParams(temperature=0.0, max_tokens=12, exit_policy="fixed")
    llm = LLM(emb, max_num_seqs=4, block_size=16)
    ref = [o.token_ids for o in llm.generate(ps, sp)]
    paths = shipped_components()
    assert {load_proposer(p, emb).draft_rounds for p in paths} == {1, 2}
    for path in paths:
        llm.set_proposer(load_proposer(path, emb, 4))
        outs = llm.generate(ps, sp)
        assert [o.token_ids for o in outs] == ref, path
        assert sum(o.spec_stats["accepted"] for o in outs) > 0
