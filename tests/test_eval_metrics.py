"""rltlab.eval: metrics by hand, depth statistics without the first token, gsm8k_cot parsing."""
import math

import pytest
import torch

from rltlab.eval import metrics as M
from rltlab.eval import gsm8k as G
from rltlab.eval import tasks as T


def test_paired_difference_by_hand():
    a = [1, 1, 0, 1, 0, 1]
    b = [1, 0, 0, 0, 1, 1]
    # d = [0, 1, 0, 1, -1, 0]: mean 1/6; sample variance = (sum d^2 - n mean^2)/(n-1)
    d_mean = 1 / 6
    var = (3 - 6 * d_mean ** 2) / 5
    res = M.paired_difference(a, b)
    assert res.n == 6 and res.diff == pytest.approx(d_mean)
    assert res.se == pytest.approx(math.sqrt(var / 6))
    assert res.mean_a == pytest.approx(4 / 6) and res.mean_b == pytest.approx(3 / 6)
    assert (res.a_only, res.b_only) == (2, 1)
    assert res.ci95[0] == pytest.approx(d_mean - 1.96 * res.se)
    assert M.paired_difference([1], [0]).se == 0.0
    with pytest.raises(ValueError):
        M.paired_difference([1, 0], [1])


def test_token_agreement():
    res = M.token_agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6, 7]])
    assert res["position"] == pytest.approx(5 / 7)   # 3 of 4, then 2 of 3 (missing = wrong)
    assert res["prefix"] == pytest.approx(4 / 7)     # prefixes 2 and 2
    assert res["exact"] == 0.0
    assert M.token_agreement([[1]], [[1]])["exact"] == 1.0


def test_depth_stats_exclude_first_token():
    selected = [[4, 1, 2, 2], [4, 3]]
    executed = [[4, 2, 2, 4], [4, 4]]
    stats = M.depth_stats(selected, executed, num_rounds=4)
    assert stats["decode_tokens"] == 4
    assert stats["mean_selected"] == pytest.approx((1 + 2 + 2 + 3) / 4)
    assert stats["mean_executed"] == pytest.approx((2 + 2 + 4 + 4) / 4)
    assert stats["selected_hist"] == {1: 1, 2: 2, 3: 1, 4: 0}  # the two leading 4s are out
    assert stats["executed_hist"] == {1: 0, 2: 2, 3: 0, 4: 2}
    assert M.depth_histogram([[4]], 4) == {1: 0, 2: 0, 3: 0, 4: 0}
    with pytest.raises(ValueError):
        M.depth_histogram([[4, 5]], 4)


def test_timing_stats():
    recs = [{"arrival_time": 0.0, "first_token_time": 0.5, "finished_time": 2.5, "num_tokens": 5},
            {"arrival_time": 1.0, "first_token_time": 1.2, "finished_time": 3.0, "num_tokens": 1},
            {"arrival_time": -5.0, "first_token_time": -4.0, "finished_time": -3.0,
             "num_tokens": 3}]  # the warm-up request (earliest arrival)
    s = M.timing_stats(recs, warmup=1)
    assert s["requests"] == 2 and s["output_tokens"] == 6
    assert s["tokens_per_s"] == pytest.approx(6 / 3.0)
    assert s["ttft_median"] == pytest.approx((0.5 + 0.2) / 2)
    assert s["tpot_median"] == pytest.approx(2.0 / 4)  # only the 5-token request has a TPOT


@pytest.mark.parametrize("text,pred,correct", [
    ("So 3 + 2 = 5. The answer is 5.\n\n", "5", True),
    ("The answer is 5", G.INVALID, False),             # the regex needs one more character
    ("The answer is 1,005.", "1,005", False),          # commas ignored: 1005 != 5
    ("The answer is 7. The answer is 5.", "7.", False),  # the FIRST match wins
    ("the answer is 5.", G.INVALID, False),            # case-sensitive regex
    ("The answer is $5.", G.INVALID, False),           # no '$' in the strict pattern
    ("The answer is -5.\n", "-5", False),
    ("The answer is 5.0.\n", "5.0", False),            # '.' does not match the newline
    ("The answer is 5.0. Done", "5.0.", False),         # '5.0.' -> '5.0' != '5'
    ("no number at all", G.INVALID, False),
])
def test_gsm8k_strict_match(text, pred, correct):
    assert G.gsm8k_strict_match(text) == pred
    assert G.gsm8k_is_correct(pred, "Janet sells 9 - 4 = <<9-4=5>>5 eggs.\n#### 5") == correct


def test_gsm8k_reference_and_commas():
    assert G.gsm8k_is_correct(G.gsm8k_strict_match("The answer is 1,000. "), "#### 1000")
    assert G.gsm8k_reference("x\n#### 72") == "72"


def test_gsm8k_prompt_and_stop():
    prompt = G.gsm8k_cot_prompt("How many?", 3)
    assert prompt.count("Q: ") == 4 and prompt.endswith("\n\nQ: How many?\nA:")
    assert prompt.startswith("Q: There are 15 trees in the grove.")
    assert "The answer is 39.\n\nQ: How many?" in prompt
    assert G.gsm8k_cot_prompt("x", 0) == "Q: x\nA:"
    assert G.truncate_at_stop(" 2 + 2 = 4. The answer is 4.\n\nQ: next") == \
        " 2 + 2 = 4. The answer is 4.\n\n"
    assert G.truncate_at_stop("a\n\nb", G.GSM8K_STOP_LEGACY) == "a"


class _CharTok:
    """A toy tokenizer: one id per character."""
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_evaluate_gsm8k_with_fake_generate(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text('{"question": "one?", "answer": "x #### 1"}\n'
                    '{"question": "two?", "answer": "y #### 2"}\n')
    tok = _CharTok()
    replies = {"one?": " The answer is 1.\n\nQ: junk The answer is 9.",
               "two?": " I think 3. The answer is 3."}

    def generate_fn(prompts):
        assert len(prompts) == 1  # batch 1
        question = tok.decode(prompts[0]).rsplit("Q: ", 1)[1][:-3]
        return [{"token_ids": tok.encode(replies[question]), "exit_depths": [4, 2, 3]}]

    res = G.evaluate_gsm8k(generate_fn, tok, path)
    assert res["scores"] == [1.0, 0.0] and res["predictions"] == ["1", "3"]
    assert res["exact_match"] == 0.5
    assert res["mean_selected"] == pytest.approx(2.5)


def test_text_perplexity_fixed_depth_matches_per_round():
    from rltlab.model.config import OuroConfig
    from rltlab.model.architecture import OuroForCausalLM
    cfg = OuroConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=2, head_dim=16, total_ut_steps=3)
    model = OuroForCausalLM(cfg).init_weights(0).double().eval()
    rows = torch.randint(0, 50, (3, 12), generator=torch.Generator().manual_seed(0))
    per_round = T.text_perplexity(model, rows, per_round=True)
    for r in (1, 2, 3):
        fixed = T.text_perplexity(model, rows, depth=r, batch_size=2)
        assert fixed["loss"] == pytest.approx(per_round["rounds"][r - 1]["loss"], rel=1e-9)
        assert fixed["mean_rounds"] == pytest.approx(r)
        assert fixed["ppl"] == pytest.approx(math.exp(fixed["loss"]))


def test_timing_records_from_engine_outputs():
    from types import SimpleNamespace as NS
    out = NS(metrics=NS(arrival_time=1.0, first_token_time=1.5, finished_time=3.5),
             outputs=[NS(token_ids=[1, 2, 3, 4, 5])])
    recs = M.timing_records([out])
    assert recs == [{"arrival_time": 1.0, "first_token_time": 1.5, "finished_time": 3.5,
                     "num_tokens": 5}]
    assert M.timing_stats(recs)["tpot_median"] == pytest.approx(0.5)


def test_engine_generate_fn_stop_strings_stop_early():
    from rltlab.model.config import OuroConfig
    from rltlab.engine import LLM, SamplingParams
    from rltlab.model.architecture import OuroForCausalLM
    torch.set_num_threads(1)
    cfg = OuroConfig(vocab_size=30, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=2, total_ut_steps=2,
                     max_position_embeddings=128)
    llm = LLM(OuroForCausalLM(cfg).init_weights(3, std=0.5).eval())

    class Tok:  # id -> one letter
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(97 + i % 26) for i in ids)
    tok = Tok()
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, seed=0)
    prompts = [[1, 2, 3], [4, 5]]
    full = T.engine_generate_fn(llm, params)(prompts)
    assert all(len(o.token_ids) == 40 for o in full)
    # stop at the text of output tokens 5..6 of the first prompt
    text0 = tok.decode(full[0].token_ids)
    stop = text0[5:7]
    early = T.engine_generate_fn(llm, params, stop=[stop], tokenizer=tok)(prompts)
    first = text0.index(stop)
    assert len(early[0].token_ids) < 40 and len(early[0].token_ids) >= first + len(stop)
    for e, f in zip(early, full):   # greedy: same text up to the stop string
        assert G.truncate_at_stop(tok.decode(e.token_ids), [stop]) == \
            G.truncate_at_stop(tok.decode(f.token_ids), [stop])
        assert e.token_ids == f.token_ids[:len(e.token_ids)]
    assert not llm.has_unfinished_requests()


def test_evaluate_policies_shows_a_bar_over_its_settings_only_when_asked(capsys):
    """progress=True: a tqdm bar over the settings on stderr (`workbench.scale evaluate
    --progress` on rank 0); the default prints nothing."""
    from rltlab.engine import LLM
    from rltlab.eval.policies import evaluate_policies
    from rltlab.eval.problems import eval_problems
    from rltlab.model.checkpoint import load_model
    model, tok, model_dir = load_model(None, hf_tokenizer=True)
    llm, problems = LLM(model, tok, max_num_seqs=4), eval_problems(model_dir, 2)
    for progress in (False, True):
        rows, _ = evaluate_policies(llm, tok, problems, depths=[1], thresholds=[0.5],
                                    max_tokens=3, progress=progress)
        assert [r["setting"] for r in rows] == ["depth=1", "t=0.5"]
        err = capsys.readouterr().err
        assert ("policies" in err and "2/2" in err) == progress, err


def test_a_policy_sweep_past_the_models_rounds_or_empty_is_one_error():
    """Notebook 04's DEPTHS [1, 5] and MIN_LOOPS 5 failed inside the engine mid-evaluation,
    and DEPTHS = THRESHOLDS = [] with a bare StopIteration."""
    from rltlab.eval.policies import check_policy_sweep

    check_policy_sweep([1, 4], [0.5], 4, num_rounds=4)   # the edges are fine
    check_policy_sweep([], [0.5], 1, num_rounds=4)
    with pytest.raises(ValueError, match=r"DEPTHS \[5, 6\]: the model runs 4 rounds"):
        check_policy_sweep([1, 5, 6], [0.5], 1, num_rounds=4)
    with pytest.raises(ValueError, match="MIN_LOOPS 5: the model runs 4 rounds"):
        check_policy_sweep([1], [0.5], 5, num_rounds=4)
    with pytest.raises(ValueError, match="both empty"):
        check_policy_sweep([], [], 1, num_rounds=4)
