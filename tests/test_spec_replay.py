"""`python -m rltlab.bench.spec_replay` (replayed acceptance, issue 60 items 5 and 6) runs on
the CPU at a tiny preset and tiny sizes: it records on the embedded model, replays the
recorded acceptance through the engine (the replay's tokens per iteration are exactly what the
recorded iterations give: the forced acceptances are the recorded ones), pairs it with target-only decoding, profiles the
verification programs, and ends with one JSON line holding the keys the issue names."""
import json

import pytest
import torch

from rltlab.bench import spec_replay

torch.set_num_threads(1)


def test_cpu_smoke_run(tmp_path, capsys):
    out = tmp_path / "replay.json"
    res = spec_replay.main(["--device", "cpu", "--preset", "tiny", "--prompts", "2",
                            "--max-tokens", "6", "--concurrency", "1", "2", "--waves", "1",
                            "--min-requests", "2", "--repeats", "1", "--record-concurrency",
                            "2", "--program-costs", "--rows", "5", "16", "--cost-tokens", "4",
                            "--cost-context", "8", "--replays", "1", "--out", str(out)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == json.loads(out.read_text()) == json.loads(json.dumps(res))
    for key in ("commit", "hardware", "dtype", "label", "recorded_tau", "switch_off_point"):
        assert key in res
    assert res["finished"] is True
    assert res["dtype"] == "float32" and "replayed acceptance" in res["label"]
    assert set(res["replayed_speedup"]) == {"T=0.0", "T=1.0"}
    for temp, by_c in res["replayed_speedup"].items():
        assert set(by_c) == {"c=1", "c=2"}
        for cell in by_c.values():
            assert cell["median"] > 0 and cell["se"] >= 0 and len(cell["ratios"]) == 1
            # forced acceptance: the replay's tokens per iteration are the recording's
            assert abs(cell["replayed_tau"] - cell["expected_tau"]) < 1e-6
    costs = res["program_cost_target_tokens"]
    assert set(costs) == {"5", "16"}
    for cell in costs.values():
        for key in ("tree_program", "generic_step", "generic_launch", "roofline"):
            assert cell[key] > 0


def test_help_lists_the_options(capsys):
    try:
        spec_replay.main(["--help"])
    except SystemExit as exit_:
        assert exit_.code == 0
    text = capsys.readouterr().out
    for option in ("--program-costs", "--concurrency", "--temperatures", "--repeats"):
        assert option in text


def test_a_run_stopped_in_the_program_costs_keeps_the_replay(tmp_path, monkeypatch):
    out = tmp_path / "replay.json"

    def stopped(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(spec_replay, "program_costs", stopped)
    with pytest.raises(KeyboardInterrupt):
        spec_replay.main(["--device", "cpu", "--preset", "tiny", "--prompts", "2",
                          "--max-tokens", "4", "--concurrency", "1", "--waves", "1",
                          "--min-requests", "1", "--repeats", "1", "--record-concurrency", "2",
                          "--program-costs", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["finished"] is False and "c=1" in saved["replayed_speedup"]["T=0.0"]
    assert "program_costs" not in saved



def test_the_recording_speculates_at_its_whole_concurrency(monkeypatch):
    """CUDA switches speculation off above 8 sequences by default; the recording runs 16. With
    a switch-off at 2 sequences wherever no limit is configured (CUDA's rule, here on the
    CPU), every request of a 4-request recording still speculates in most of its steps, and
    its items account for every token it emitted (the replay decodes the same lengths)."""
    import argparse
    from rltlab.engine.spec.decoder import SpecDecoder

    def cuda_like(self):
        return self.engine.config.execution.spec_max_concurrency or 2

    monkeypatch.setattr(SpecDecoder, "max_concurrency", cuda_like)
    ap = argparse.ArgumentParser()
    spec_replay.add_proposer_arguments(ap, max_tokens=24)
    args = ap.parse_args(["--prompts", "4"])
    args.device, args.temperatures, args.record_concurrency = "cpu", [0.0], 4
    args.ignore_eos = True
    for r in spec_replay.record(args)["requests"][0.0]:
        assert r["length"] == r["stopped_at"] == 24
        plain = sum(it[1] for it in r["items"] if it[0] == "plain")
        assert plain < 12, r["items"]
