"""rltlab.eval.plots: every plot writes a non-empty PNG and SVG."""
import numpy as np
import pandas as pd
import pytest

from rltlab.eval import plots


def _check(paths, stem):
    assert [p.suffix for p in paths] == [".png", ".svg"]
    assert all(p.stem == stem for p in paths)
    png, svg = paths
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5_000
    text = svg.read_text()
    assert "<svg" in text and svg.stat().st_size > 5_000
    return text


def test_quality_vs_depth(tmp_path):
    rng = np.random.default_rng(0)
    rows = []
    for policy in ("q-exit", "fixed"):
        for t in np.linspace(0.1, 0.9, 6):
            rows.append({"policy": policy, "mean_rounds": 1 + 3 * rng.random(),
                         "quality": 100 * rng.random(), "threshold": t, "se": rng.random()})
    svg = _check(plots.plot_quality_vs_depth(pd.DataFrame(rows), tmp_path, label="threshold",
                                             yerr="se"), "quality_vs_depth")
    assert "mean executed rounds" in svg  # axis label text is kept in the SVG
    # plain list-of-dicts input works too
    _check(plots.plot_quality_vs_depth(rows, tmp_path / "b"), "quality_vs_depth")
    with pytest.raises(ValueError, match="lacks column"):
        plots.plot_quality_vs_depth([{"x": 1}], tmp_path)


def test_quality_vs_depth_keeps_error_bars_in_view(tmp_path, monkeypatch):
    """The y axis stopped at 1.1 x the best quality, cutting off a 95 +- 10 point's bar."""
    tops = []
    real = plots.save_figure

    def keep(fig, out_dir, stem):
        tops.append(fig.axes[0].get_ylim()[1])
        return real(fig, out_dir, stem)

    monkeypatch.setattr(plots, "save_figure", keep)
    rows = [{"policy": "q", "mean_rounds": 2.0, "quality": 95.0, "se": 10.0},
            {"policy": "q", "mean_rounds": 3.0, "quality": 90.0, "se": 2.0}]
    plots.plot_quality_vs_depth(rows, tmp_path, yerr="se")
    assert tops[0] >= 105


def test_pareto_front():
    idx = plots.pareto_front([1, 2, 3, 2.5], [0.5, 0.4, 0.9, 0.95])
    assert idx.tolist() == [0, 3]


def test_speedup_vs_concurrency(tmp_path):
    rng = np.random.default_rng(1)
    df = {"concurrency": [1, 8, 32, 128] * 2, "speedup": (0.8 + rng.random(8)).tolist(),
          "policy": ["spec"] * 4 + ["early-exit"] * 4}
    _check(plots.plot_speedup_vs_concurrency(df, tmp_path), "speedup_vs_concurrency")


def test_depth_histogram(tmp_path):
    rng = np.random.default_rng(2)
    depths = {"q-exit 0.5": rng.integers(1, 5, 300).tolist(),
              "fixed 4": {4: 120}, "hist": {1: 3, 2: 10, 3: 7, 4: 1}}
    _check(plots.plot_depth_histogram(depths, tmp_path, num_rounds=4), "depth_histogram")


def test_calibration(tmp_path):
    rng = np.random.default_rng(3)
    probs = rng.random(500)
    labels = (rng.random(500) < probs).astype(int)
    _check(plots.plot_calibration(probs, labels, tmp_path), "calibration")
    curve = plots.reliability_curve(probs, labels)
    assert curve["count"].sum() == 500 and 0 <= curve["ece"] < 0.15
    with pytest.raises(ValueError):
        plots.plot_calibration([0.1], [1, 0], tmp_path)
