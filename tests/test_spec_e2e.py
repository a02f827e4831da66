"""`python -m rltlab.bench.spec_e2e` (issue 60: the embedded model end to end at c = 1, T = 0
and 1) runs on the CPU at tiny sizes: both sides decode the same prompts, T = 0's tokens are
identical, and the last line is the JSON with the paired speedup per temperature."""
import json

import pytest
import torch

from rltlab.bench import spec_e2e

torch.set_num_threads(1)


def test_cpu_smoke_run(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    res = spec_e2e.main(["--device", "cpu", "--prompts", "2", "--max-tokens", "6",
                         "--repeats", "2", "--out", str(out)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert {"commit", "hardware", "device", "dtype", "goal_t1_c1"} <= set(res)
    assert set(res["temperatures"]) == {"T=0", "T=1"}
    for cell in res["temperatures"].values():
        assert cell["target_tok_s"] > 0 and cell["spec_tok_s"] > 0 and cell["tau"] >= 1
        assert len(cell["speedup"]["ratios"]) == 2 and cell["speedup"]["se"] >= 0
    assert res["temperatures"]["T=0"]["identical_tokens"] is True


def test_paired_speedup_is_spec_over_target_per_repeat():
    got = spec_e2e.paired_speedup([10.0, 20.0, 40.0], [15.0, 20.0, 100.0])
    assert got["ratios"] == [1.5, 1.0, 2.5]
    assert got["median"] == 1.5 and got["mean"] == pytest.approx(5 / 3)
    assert got["se"] == pytest.approx(0.7637626158 / 3 ** 0.5)
    with pytest.raises(ValueError, match="equally many"):
        spec_e2e.paired_speedup([1.0], [1.0, 2.0])


def test_bad_sizes_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as exit_:
        spec_e2e.main(["--device", "cpu", "--repeats", "0"])
    assert exit_.value.code == 2 and "--repeats must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("proposer, engine", [("plain", "default"), ("fastest", "measured")])
def test_both_proposer_and_engine_settings_run_lossless(proposer, engine, monkeypatch):
    """--proposer / --engine reach the TreeProposer and the LLM (tree_llm's options and
    settings by default), and T = 0 stays token-identical with either."""
    from rltlab.engine import LLM, TreeProposer
    seen = {}
    real_llm, real_proposer = LLM.__init__, TreeProposer.__init__

    def llm_init(self, *a, **kw):
        seen["engine"] = kw
        real_llm(self, *a, **kw)

    def proposer_init(self, *a, **kw):
        seen["proposer"] = kw
        real_proposer(self, *a, **kw)

    monkeypatch.setattr(LLM, "__init__", llm_init)
    monkeypatch.setattr(TreeProposer, "__init__", proposer_init)
    res = spec_e2e.main(["--device", "cpu", "--prompts", "2", "--max-tokens", "6", "--repeats",
                         "1", "--temperatures", "0", "--proposer", proposer, "--engine", engine])
    assert res["temperatures"]["T=0"]["identical_tokens"] is True
    if proposer == "fastest":
        assert seen["proposer"] == {"lookup": 10, "first_drafts": True, "adaptive_lookup": "agree"}
    else:
        assert seen["proposer"] == {"lookup": 10}
    assert seen["engine"].get("launch_behind_prompt", False) is (engine == "measured")
