"""python -m rltlab.bench.device_parity: two notebook-10 run directories compared row by row."""
import json

import pytest

from rltlab.bench import device_parity


def _run(path, v0_scores, v1_scores, digest="abc", headline=None):
    """A run directory as notebook 10 writes it, reduced to what the bench reads."""
    def ev(version, scores, sha):
        key = f"v{version} q_exit t=0.5"
        row = {"key": key, "quality": 100 * sum(scores) / len(scores), "weight_version": version,
               "tokens_sha256": sha, "device": str(path.name)}
        return {"rows": [row], "scores": {key: scores}}
    (path / "iter_0").mkdir(parents=True)
    (path / "iter_0" / "result.json").write_text(json.dumps(
        {"before": ev(0, v0_scores, digest), "after": ev(1, v1_scores, digest + "1")}))
    (path / "metrics.json").write_text(json.dumps({"headline": headline or {"q": 1.0}}))
    return path


def test_identical_runs_agree_and_share_their_greedy_tokens(tmp_path):
    scores = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    a = _run(tmp_path / "cpu", scores, scores)
    b = _run(tmp_path / "cuda", scores, scores, headline={"q": 2.0})
    result = device_parity.main([str(a), str(b), "--out", str(tmp_path / "p.json")])
    assert result["greedy_v0_identical_tokens"] and result["all_agree"]
    assert result["rows_compared"] == 2 and result["greedy_v0_rows"] == 1
    assert result["headline"] == {"q": [1.0, 2.0]}
    assert json.loads((tmp_path / "p.json").read_text()) == result


def test_other_tokens_and_a_quality_gap_beyond_two_se_are_reported(tmp_path):
    a = _run(tmp_path / "cpu", [1.0] * 8, [1.0] * 8)
    b = _run(tmp_path / "cuda", [1.0] * 8, [1.0, 0.0] * 4, digest="other")
    result = device_parity.main([str(a), str(b)])
    assert not result["greedy_v0_identical_tokens"]
    (v0,) = [r for r in result["rows"] if r["weight_version"] == 0]
    (v1,) = [r for r in result["rows"] if r["weight_version"] == 1]
    assert v0["agree"] and v0["diff_pp"] == 0 and not v0["same_tokens"]
    assert v1["diff_pp"] == pytest.approx(-50.0) and not v1["agree"]   # -50 pp, SE ~19 pp
    assert not result["all_agree"]


def test_a_directory_without_a_run_is_one_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        device_parity.main([str(tmp_path), str(tmp_path)])
    assert "no metrics.json" in capsys.readouterr().err
