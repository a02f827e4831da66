"""The `python -m rltlab...` commands on bad input: a usage error or one "error:" line with
exit status 2, never a traceback, and nothing written. Each command runs in this process
through runpy, so its `if __name__ == "__main__"` block is what is tested."""
from __future__ import annotations

import runpy
import sys
import warnings

import pytest

from rltlab.common.command import run_command

# module, the arguments it requires besides the one under test ({out}: a path under tmp_path)
DEVICE_COMMANDS = [
    ("rltlab.bench", []), ("rltlab.bench.depth_gain", []), ("rltlab.bench.engine", []),
    ("rltlab.bench.paired", []), ("rltlab.bench.spec", []), ("rltlab.bench.gap", []),
    ("rltlab.bench.tree_spec", []), ("rltlab.bench.scale", []), ("rltlab.bench.first_loop", []),
    ("rltlab.model.standin", ["{out}/config.json", "{out}/standin"]),
    ("rltlab.draft_heads.run", ["--out", "{out}"]),
    ("rltlab.draft_heads.lookahead_train", ["--out", "{out}"]),
    ("rltlab.draft_heads.selfdistill", []), ("rltlab.pretrain.evaluate", ["{out}"]),
    ("rltlab.workbench.scale", ["collect", "--out", "{out}"]),
]
MODEL_COMMANDS = [
    ("rltlab.bench", "--model", []), ("rltlab.bench.gap", "--model", []),
    ("rltlab.bench.tree_spec", "--model", ["--out", "{out}/r.json"]),
    ("rltlab.bench.tree_sim", "--model", []), ("rltlab.bench.scale", "--model", ["--out", "{out}"]),
    ("rltlab.bench.first_loop", "--model", []),
    ("rltlab.draft_heads.evaluate", "--model", ["--out", "{out}"]),
    ("rltlab.draft_heads.selfdistill", "--model", ["--out", "{out}"]),
    ("rltlab.draft_heads.lookahead_train", "--model", ["--out", "{out}"]),
    ("rltlab.exit_predictor.data", "--model-dir", ["--out", "{out}"]),
    ("rltlab.exit_predictor.evaluate", "--model-dir", ["--out", "{out}"]),
    ("rltlab.pretrain.evaluate", None, []),
]


def _run_as_main(module: str, argv: list[str], monkeypatch) -> int:
    """-> the exit status of `python -m module *argv`, run in this process."""
    monkeypatch.setattr(sys, "argv", [module, *argv])
    with warnings.catch_warnings():   # runpy: "found in sys.modules ... prior to execution"
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(SystemExit) as stop:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    return stop.value.code


@pytest.mark.parametrize("module,required", DEVICE_COMMANDS, ids=[m for m, _ in DEVICE_COMMANDS])
def test_a_bad_device_is_a_usage_error(module, required, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    argv = [a.format(out=out) for a in required] + ["--device", "nosuch"]
    assert _run_as_main(module, argv, monkeypatch) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: argument --device: 'nosuch' is not a torch device" in last, last
    assert not out.exists()


@pytest.mark.parametrize("module,option,required", MODEL_COMMANDS,
                         ids=[m for m, _, _ in MODEL_COMMANDS])
def test_a_missing_checkpoint_is_one_error_line(module, option, required, tmp_path, capsys,
                                                monkeypatch):
    out, missing = tmp_path / "out", tmp_path / "no-checkpoint"
    argv = [a.format(out=out) for a in required] + ([option, str(missing)] if option
                                                    else [str(missing)])
    assert _run_as_main(module, argv, monkeypatch) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "Traceback" not in "\n".join(err), err
    assert "error: " in err[-1] and f"{missing} does not exist" in err[-1], err
    assert not out.exists()


def test_missing_lookahead_heads_are_one_error_line(tmp_path, capsys, monkeypatch):
    out, heads = tmp_path / "out.json", tmp_path / "no-heads"
    argv = ["--heads", str(heads), "--prompts", "2", "--max-tokens", "2", "--out", str(out)]
    assert _run_as_main("rltlab.bench.tree_spec", argv, monkeypatch) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"error: {heads} holds no lookahead heads (lookahead.json + " \
                      "heads.safetensors)", err
    assert not out.exists()


def test_tree_spec_names_the_limits_its_options_break(capsys, monkeypatch):
    argv = ["--prompts", "1", "--lookup", "17", "--repeats", "2"]
    assert _run_as_main("rltlab.bench.tree_spec", argv, monkeypatch) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith("error: needs --prompts >= 2, --lookup in 0..16 (the block size)"), last


def test_run_command_keeps_other_errors_and_the_result():
    """Only a missing input becomes an error line: a bug keeps its exception (and traceback)."""
    assert run_command(lambda: {"x": 1}) == {"x": 1}

    def broken():
        raise ValueError("a bug")
    with pytest.raises(ValueError, match="a bug"):
        run_command(broken)


@pytest.mark.parametrize("module", ["rltlab.bench.engine", "rltlab.bench.paired",
                                    "rltlab.bench.first_loop"])
@pytest.mark.parametrize("option,value,message", [
    ("--kv-gib", "0", "must be a finite number of GiB > 0, got 0"),
    ("--kv-gib", "nan", "must be a finite number of GiB > 0, got nan"),
    ("--dtype", "fp32", "invalid choice: 'fp32'"),
    ("--scale", "0", "must be a finite factor > 0, got 0"),
    ("--scale", "-1", "must be a finite factor > 0, got -1"),
])
def test_bad_kv_memory_dtype_or_scale_is_a_usage_error(module, option, value, message, capsys,
                                                 monkeypatch):
    """--kv-gib 0 was a traceback (first_loop) or a failed mode with exit 0 (engine);
    --dtype fp32 an AttributeError from torch; --scale 0 ran the minimum sizes without a word."""
    assert _run_as_main(module, ["--preset", "tiny", option, value], monkeypatch) == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_gemv_bench_refuses_a_row_count_below_one(capsys, monkeypatch):
    """Checked before the bench looks for a GPU: a usage line, not a GPU message."""
    assert _run_as_main("rltlab.bench.gemv", ["--cublas-rows", "128", "0"], monkeypatch) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "error: --rows and --cublas-rows take row counts >= 1")
