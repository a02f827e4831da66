"""Fault suite, run directories (issue 18, section C): re-runs that duplicated traces,
`--run-dir` into foreign directories, concurrent executions, resumes with other parameters,
interrupts and kills. Damaged run files (section E): test_faults_run_files.py.
docs/reliability.md lists each fault with its test."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
import torch

from rltlab.workbench import runs, runs_cli

from file_modes import assert_umask_permissions

DATA = Path(__file__).parent / "data"
NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
TINY = DATA / "tiny_notebook.ipynb"
LONG_ERROR = "x" * 3000 + " THE REAL CAUSE"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One torch thread for the in-process engines on tiny models (the notebooks get THREADS
    1): under load (CI runs two workers on two cores) a second thread only spins. Restored for
    the worker's next module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- helpers

@pytest.fixture(scope="module")
def probe_notebook(tmp_path_factory):
    """tiny_notebook plus HOLD (wait until that file exists, after writing RUN_DIR/started and
    a loop-style temporary dir) and FAIL_MESSAGE (raise with it)."""
    nb = nbformat.read(str(TINY), as_version=4)
    nb.cells[1].source += ('\nHOLD = ""  # wait (up to 120 s) until this file exists\n'
                           'FAIL_MESSAGE = ""  # raise a RuntimeError with it\n')
    nb.cells.insert(2, nbformat.v4.new_code_cell(
        "import time\nfrom pathlib import Path\n"
        "(Path(RUN_DIR) / '.iter_0.tmp-probe').mkdir(exist_ok=True)\n"
        # written whole, then renamed: a test that sees `started` must never read it empty
        "(Path(RUN_DIR) / '.started').write_text('1')\n"
        "(Path(RUN_DIR) / '.started').rename(Path(RUN_DIR) / 'started')\nt0 = time.time()\n"
        "while HOLD and not Path(HOLD).exists() and time.time() - t0 < 120:\n"
        "    time.sleep(0.05)\nif FAIL_MESSAGE:\n    raise RuntimeError(FAIL_MESSAGE)"))
    path = tmp_path_factory.mktemp("nb") / "probe.ipynb"
    nbformat.write(nb, str(path))
    return path


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from tiny_models import write_tiny_checkpoint
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


def _cli(*argv):
    """(exit code) of `rltlab run|runs ...` in this process."""
    from rltlab.workbench.cli import build_parser
    return runs_cli.main(build_parser(argv[0]).parse_args(list(argv)))


def _spawn_cli(*argv):
    """`rltlab run ...` as a real process; SIGINT at its default, as in a terminal."""
    return subprocess.Popen(
        [sys.executable, "-m", "rltlab.workbench.cli", *argv], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for(path, proc, timeout=120):
    t0 = time.time()
    while not Path(path).exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t0 < timeout, f"{path} never appeared"
        time.sleep(0.05)


def _snapshot(directory):
    """{relative path: bytes} of every file under directory (None for a directory)."""
    root = Path(directory)
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
            for p in sorted(root.rglob("*"))}


def _record(run_dir):
    return json.loads((Path(run_dir) / "run.json").read_text())


# ----------------------------------------------------------------------------- C1

@pytest.mark.slow
def test_collect_notebook_rerun_reuses_the_traces(tiny_model_dir, tmp_path):
    """C1: re-running notebook 01 into its run dir appended a second copy of every trace."""
    from rltlab.traces import load_traces, verify_traces
    run_dir = tmp_path / "collect"
    params = {"MODEL_DIR": str(tiny_model_dir), "NUM_PROMPTS": 3, "MAX_TOKENS": 5,
              "SHARD_TOKENS": 4, "MEASURE_OVERHEAD": False, "THREADS": 1}
    runs.execute_notebook(NOTEBOOKS / "01_collect_traces.ipynb", params, run_dir=run_dir,
                          progress=False)
    first = _snapshot(run_dir / "traces")
    assert verify_traces(run_dir / "traces")["num_tokens"] == 3 * 4
    runs.execute_notebook(NOTEBOOKS / "01_collect_traces.ipynb", {}, run_dir=run_dir,
                          progress=False)   # a resume: the stored parameters
    assert verify_traces(run_dir / "traces")["num_tokens"] == 3 * 4
    assert _snapshot(run_dir / "traces") == first     # reused, not collected again
    tr = load_traces(run_dir / "traces", fields=["prompt_id", "position"])
    keys = set(zip(tr["prompt_id"].tolist(), tr["position"].tolist()))
    assert len(keys) == 3 * 4
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["headline"]["traced_tokens"] == 12
    executed = (run_dir / "01_collect_traces.ipynb").read_text()
    assert "checksums verified" in executed
    assert "(a finished collection of an earlier execution, reused)" in executed


def test_collect_traces_once_replaces_a_changed_collection(tmp_path):
    """C1: other settings or another model replace the traces once the new ones are complete;
    a partial directory (killed collection) is replaced, never appended to."""
    from rltlab.engine import LLM
    from rltlab.traces import load_traces, verify_traces
    from rltlab.workbench import collect_traces_once
    from tiny_models import tiny_engine_model

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 61, (5,), generator=gen).tolist() for _ in range(3)]
    llm = LLM(tiny_engine_model(0))
    trace_dir = tmp_path / "run" / "traces"
    kwargs = dict(threshold=0.5, max_tokens=4, teacher=True, seed=0, shard_tokens=5)

    _, reused = collect_traces_once(llm, prompts, trace_dir, **kwargs)
    n = verify_traces(trace_dir)["num_tokens"]
    assert not reused and n > 0
    _, reused = collect_traces_once(llm, prompts, trace_dir, **kwargs)
    assert reused and verify_traces(trace_dir)["num_tokens"] == n

    manifest, reused = collect_traces_once(llm, prompts, trace_dir, **{**kwargs,
                                                                       "max_tokens": 6})
    m = verify_traces(trace_dir)["num_tokens"]
    assert not reused and m == manifest["num_tokens"] and m > n
    tr = load_traces(trace_dir, fields=["prompt_id", "position"])
    assert len(set(zip(tr["prompt_id"].tolist(), tr["position"].tolist()))) == m  # no copies

    _, reused = collect_traces_once(LLM(tiny_engine_model(1)), prompts, trace_dir,
                                    **{**kwargs, "max_tokens": 6})
    assert not reused and verify_traces(trace_dir)["num_tokens"] == m   # other weights

    (trace_dir / "collection.json").unlink()          # as a killed old-style collection
    (trace_dir.parent / ".traces.tmp-killed").mkdir()
    _, reused = collect_traces_once(llm, prompts, trace_dir, **{**kwargs, "max_tokens": 6})
    assert not reused and verify_traces(trace_dir)["num_tokens"] == m
    assert sorted(p.name for p in trace_dir.parent.iterdir()) == ["traces"]
    assert_umask_permissions(trace_dir)


# ----------------------------------------------------------------------------- C2

def test_run_dir_refuses_foreign_directories(tmp_path):
    """C2: --run-dir wrote into any directory (a model directory lost its metrics.json)."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"hidden_size": 8}')
    (model_dir / "metrics.json").write_text('{"loss": 1.5}')
    other = tmp_path / "other-run"
    other.mkdir()
    (other / "run.json").write_text(json.dumps({"notebook_name": "01_collect_traces",
                                                "status": "finished"}))
    odd = tmp_path / "odd-run"
    odd.mkdir()
    (odd / "run.json").write_text('{"notebook": 5}')
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases = [(model_dir, "not a run directory.*config.json"),
             (other, "run of notebook '01_collect_traces', not 'tiny_notebook'"),
             (odd, r"run.json: field 'notebook'"), (a_file, "is a file")]
    for target, message in cases:
        before = _snapshot(tmp_path)
        with pytest.raises(ValueError, match=message) as err:
            runs.execute_notebook(TINY, {}, run_dir=target, progress=False)
        assert type(err.value).__name__ == "RunRefused"
        assert _snapshot(tmp_path) == before, target      # not even a lock file
    assert _cli("run", str(TINY), "--run-dir", str(model_dir), "--no-progress") == 2
    assert _snapshot(tmp_path) == before


def test_run_dir_parameter_is_the_run_directory(tmp_path, monkeypatch, capsys):
    """C2: `rltlab run NB -p RUN_DIR D` made a new run directory anyway (and `-p RUN_DIR
    /etc/hostname` ran with defaults). -p RUN_DIR is --run-dir; both with different values are
    refused; a RUN_DIR that cannot be a directory is refused before the notebook starts."""
    monkeypatch.setenv("RLTLAB_RUNS_DIR", str(tmp_path / "runs"))
    calls = []
    monkeypatch.setattr(runs, "execute_notebook",
                        lambda nb, params, run_dir, **kw: calls.append((run_dir, params)))
    target = tmp_path / "mine"
    assert _cli("run", str(TINY), "-p", "RUN_DIR", str(target), "-p", "STEPS", "2",
                "--no-progress") == 0
    assert calls == [(str(target), {"STEPS": 2})]        # RUN_DIR is not passed on as a value
    for same in (str(target), str(target) + "/", str(tmp_path / "." / "mine")):
        assert _cli("run", str(TINY), "-p", "RUN_DIR", same, "--run-dir", str(target),
                    "--no-progress") == 0
    assert _cli("run", str(TINY), "-p", "RUN_DIR", "None", "--no-progress") == 0
    assert calls[-1][0] != "None" and Path(calls[-1][0]).parent == tmp_path / "runs"
    capsys.readouterr()
    assert _cli("run", str(TINY), "-p", "RUN_DIR", str(tmp_path / "a"), "--run-dir",
                str(tmp_path / "b"), "--no-progress") == 2
    err = capsys.readouterr().err
    assert len(calls) == 5 and err.count("\n") == 1
    assert "-p RUN_DIR" in err and "--run-dir" in err and "differ" in err
    assert _cli("run", str(TINY), "--list-parameters") == 0
    assert "same as --run-dir" in capsys.readouterr().out


def test_run_dir_that_cannot_be_a_directory_is_refused_in_one_line(tmp_path, capsys,
                                                                   monkeypatch):
    """E: a --run-dir under /proc or below a file failed inside execution, pointing at a
    notebook file that was never written."""
    monkeypatch.setenv("RLTLAB_RUNS_DIR", str(tmp_path / "runs"))
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases = [(a_file, "is a file"), (a_file / "run", "below a file"),
             (a_file / "x" / "run", "below a file"), (Path("/proc/rltlab-run"), "/proc"),
             (Path("/proc/self/rltlab-run"), "/proc")]
    for target, message in cases:
        before = _snapshot(tmp_path)
        with pytest.raises(ValueError, match=message) as err:
            runs.execute_notebook(TINY, {}, run_dir=target, progress=False)
        assert type(err.value).__name__ == "RunRefused"
        for how in (("--run-dir", str(target)), ("-p", "RUN_DIR", str(target))):
            assert _cli("run", str(TINY), *how, "--no-progress") == 2
            err = capsys.readouterr().err
            assert err.startswith("error: ") and err.count("\n") == 1, err
            assert message in err and ".ipynb" not in err
        assert _snapshot(tmp_path) == before
        assert target == a_file or not target.exists()


def test_inputs_a_notebook_would_miss_mid_run_are_refused_before_anything_is_written(
        tmp_path, capsys, monkeypatch):
    """A MODEL_DIR or TRACE_DIR that is not a directory, a MODEL_DIR without a checkpoint's
    files, TASKS gsm8k without GSM8K_PATH, a GSM8K_PATH that is no file, --start-over without
    a run directory: each failed inside the notebook (one after a
    478 s evaluation), leaving a failed run directory. Now: one error line, exit 2, nothing
    written; through the API a RunRefused."""
    monkeypatch.setenv("RLTLAB_RUNS_DIR", str(tmp_path / "runs"))
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    no_model = tmp_path / "not-a-model"
    no_model.mkdir()
    (no_model / "config.json").write_text("{}")
    cases = [("04", ["-p", "MODEL_DIR", str(tmp_path / "none")], "MODEL_DIR", "not a directory"),
             ("04", ["-p", "MODEL_DIR", str(a_file)], "MODEL_DIR", "not a directory"),
             ("04", ["-p", "MODEL_DIR", str(no_model)], "MODEL_DIR",
              "not a checkpoint directory, it has no tokenizer.json, model.safetensors"),
             ("03", ["-p", "TRACE_DIR", str(tmp_path / "none")], "TRACE_DIR", "not a directory"),
             ("04", ["-p", "TASKS", "gsm8k"], "TASKS", "needs GSM8K_PATH"),
             ("04", ["-p", "GSM8K_PATH", str(tmp_path / "no.jsonl")], "GSM8K_PATH", "no such file"),
             ("04", ["-p", "GSM8K_PATH", str(no_model)], "GSM8K_PATH", "a directory, not a file"),
             ("04", ["--start-over"], "--start-over", "--run-dir")]
    before = _snapshot(tmp_path)
    for notebook, argv, name, message in cases:
        assert _cli("run", notebook, *argv, "--no-progress") == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
        assert name in err and message in err, err
        if argv[0] == "-p":
            with pytest.raises(ValueError, match=message) as refused:
                runs.execute_notebook(runs.resolve_notebook(notebook), {argv[1]: argv[2]},
                                      progress=False)
            assert type(refused.value).__name__ == "RunRefused"
    assert _snapshot(tmp_path) == before


def test_an_empty_sweep_that_would_break_the_notebook_is_refused(tmp_path, capsys,
                                                                monkeypatch):
    """`-p THRESHOLDS "[]"` to notebook 10 passed the checks and failed after 28 s ("a curve
    needs at least one point"), leaving a failed run directory: now one line, exit 2. (The
    other notebooks' sweeps run empty: 02's and 04's each skip that family.)"""
    monkeypatch.setenv("RLTLAB_RUNS_DIR", str(tmp_path / "runs"))
    before = _snapshot(tmp_path)
    assert _cli("run", "10", "-p", "THRESHOLDS", "[]", "--no-progress") == 2
    err = capsys.readouterr().err
    assert err == "error: parameter THRESHOLDS=[]: THRESHOLDS must not be empty\n", err
    assert _snapshot(tmp_path) == before
    spec = runs.notebook_parameters(runs.resolve_notebook("10"))["THRESHOLDS"]
    assert spec["non_empty"] and spec["bounds"] == [(">=", 0.0), ("<=", 1.0)]


# ----------------------------------------------------------------------------- C3

@pytest.mark.slow
def test_second_execution_on_a_run_dir_is_refused(probe_notebook, tmp_path, capsys):
    """C3: two `rltlab run --run-dir D` at once: the second deleted the first's temporary
    iteration dirs and marked the finished run failed. Now it is refused, changing nothing."""
    run_dir, go = tmp_path / "run", tmp_path / "go"
    winner = _spawn_cli("run", str(probe_notebook), "--run-dir", str(run_dir), "-p", "HOLD",
                        str(go), "--no-progress")
    try:
        _wait_for(run_dir / "started", winner)
        held = _snapshot(run_dir)
        assert ".iter_0.tmp-probe" in held and _record(run_dir)["status"] == "running"
        with pytest.raises(ValueError, match="in use by another execution.*pid") as busy:
            runs.execute_notebook(probe_notebook, {"STEPS": 2, "HOLD": ""}, run_dir=run_dir,
                                  progress=False)
        assert type(busy.value).__name__ == "RunDirBusy"
        assert _cli("run", str(probe_notebook), "--run-dir", str(run_dir), "--no-progress",
                    "-p", "HOLD", "") == 2
        assert "in use by another execution" in capsys.readouterr().err
        assert _snapshot(run_dir) == held
        listed = runs.list_runs(tmp_path)
        assert [r["status"] for r in listed] == ["running"]
        go.write_text("1")
        out, err = winner.communicate(timeout=120)
    finally:
        go.write_text("1")
        if winner.poll() is None:
            winner.kill()
            winner.wait()
    assert winner.returncode == 0, err
    assert _record(run_dir)["status"] == "finished"
    assert (run_dir / ".iter_0.tmp-probe").is_dir()
    assert [a["status"] for a in _record(run_dir)["attempts"]] == ["finished"]


# ----------------------------------------------------------------------------- C5

@pytest.mark.slow
def test_kill_and_interrupt_are_recorded(probe_notebook, tmp_path):
    """C5: SIGKILL left "running" for as long as the pid looked alive (here: a zombie nobody
    reaped); SIGINT left a raw traceback and recorded "failed"."""
    run_dir, never = tmp_path / "run", tmp_path / "never"
    argv = ("run", str(probe_notebook), "--run-dir", str(run_dir), "-p", "HOLD", str(never),
            "--no-progress")
    killed = _spawn_cli(*argv)
    _wait_for(run_dir / "started", killed)
    killed.kill()      # and not reaped before the listing: its pid stays (a zombie)
    deadline = time.monotonic() + 15   # the orphaned kernel may hold on for a second or two
    while True:
        [entry] = runs.list_runs(tmp_path)
        if entry["status"] == "interrupted" or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert entry["status"] == "interrupted"
    killed.communicate(timeout=60)

    (run_dir / "started").unlink()
    interrupted = _spawn_cli(*argv)
    _wait_for(run_dir / "started", interrupted)
    interrupted.send_signal(signal.SIGINT)
    out, err = interrupted.communicate(timeout=60)
    assert interrupted.returncode == 130
    assert "Traceback" not in err and "interrupted" in err and "--run-dir" in err
    record = _record(run_dir)
    assert record["status"] == "interrupted" and "KeyboardInterrupt" in record["error"]
    assert [a["status"] for a in record["attempts"]] == ["interrupted", "interrupted"]
    assert "killed" in record["attempts"][0]["note"]
    assert [r["status"] for r in runs.list_runs(tmp_path)] == ["interrupted"]


@pytest.mark.slow
def test_failed_rerun_marks_the_headline_stale_and_keeps_the_error_tail(
        probe_notebook, tmp_path, capsys, monkeypatch):
    """C5: after a failed re-run `rltlab runs` showed the old headline beside "failed", and
    the error was cut at 2,000 characters from the start, hiding the exception. Also
    --start-over: the run dir is cleared, the stored parameters are not the base."""
    monkeypatch.setenv("RLTLAB_RUNS_DIR", str(tmp_path))
    run_dir = tmp_path / "2026-12-01-probe"
    runs.execute_notebook(probe_notebook, {"STEPS": 4}, run_dir=run_dir, progress=False)
    assert _cli("run", str(probe_notebook), "--run-dir", str(run_dir), "--no-progress",
                "-p", "FAIL_MESSAGE", LONG_ERROR) == 1
    assert "THE REAL CAUSE" in capsys.readouterr().err
    record = _record(run_dir)
    assert record["status"] == "failed" and record["error"].endswith("THE REAL CAUSE")
    assert len(record["error"]) < 2100
    [entry] = runs.list_runs()
    assert entry["status"] == "failed" and entry["metrics_stale"] is True
    assert _cli("runs") == 0
    listing = capsys.readouterr().out
    assert "(stale: from an earlier attempt) steps=4" in listing
    assert "error: " in listing and "THE REAL CAUSE; (stale" in listing   # why, first

    (run_dir / "leftover.txt").write_text("from an earlier execution")
    runs.execute_notebook(probe_notebook, {"STEPS": 2}, run_dir=run_dir, progress=False,
                          start_over=True)
    assert not (run_dir / "leftover.txt").exists()
    assert json.loads((run_dir / "parameters.json").read_text()).get("FAIL_MESSAGE") is None
    record = _record(run_dir)
    assert record["status"] == "finished" and record["attempts"][-1]["start_over"] is True
    assert len(record["attempts"]) == 3
    [entry] = runs.list_runs()
    assert entry["metrics"] == {"steps": 2, "total": 1.5} and entry["metrics_stale"] is False


# ----------------------------------------------------------------------------- C6

def test_runs_listing_survives_damaged_runs(tmp_path, capsys):
    """C6: one bad metrics.json or run.json crashed the whole `rltlab runs` listing."""
    def make(name, run=None, metrics=None):
        d = tmp_path / name
        d.mkdir()
        for file, content in (("run.json", run), ("metrics.json", metrics)):
            if content is not None:
                (d / file).write_bytes(content if isinstance(content, bytes)
                                       else content.encode())
    good = json.dumps({"notebook_name": "04_evaluate", "status": "finished", "seconds": 3})
    make("2026-12-01-good", good, json.dumps({"headline": {"quality": 97.5}}))
    make("2026-12-01-binary-metrics", good, b"\x89PNG\r\n\x1a\n\x00\xff")
    make("2026-12-01-list-metrics", good, "[1, 2]")
    make("2026-12-01-list-headline", good, '{"headline": [1]}')
    make("2026-12-01-list-run", "[]")
    make("2026-12-01-notebook-5", '{"notebook": 5, "status": "finished"}')
    make("2026-12-01-truncated-run", '{"notebook_name": "04_evaluate", "sta')
    make("2026-12-01-attempts", '{"notebook_name": "x", "attempts": [3]}')
    listed = {r["name"][11:]: r for r in runs.list_runs(tmp_path)}
    assert len(listed) == 8
    assert listed["good"]["status"] == "finished" and listed["good"]["metrics"] == {
        "quality": 97.5}
    problems = {"binary-metrics": "metrics.json: not text", "list-metrics": "metrics.json: "
                "holds a list", "list-headline": "metrics.json: field 'headline'",
                "list-run": "run.json: holds a list", "notebook-5": "run.json: field 'notebook'",
                "truncated-run": "run.json: truncated", "attempts": "field 'attempts[0]'"}
    for name, message in problems.items():
        assert listed[name]["status"] == "unreadable", name
        assert message in listed[name]["problem"], (name, listed[name]["problem"])
    assert _cli("runs", "--root", str(tmp_path)) == 0
    table = capsys.readouterr().out
    assert "quality=97.5" in table and table.count("unreadable") == 7


def test_runs_listing_survives_deeply_nested_json(tmp_path, capsys):
    """C6: one deeply nested metrics.json raised RecursionError and hid every run."""
    deep = "[" * 100_000 + "]" * 100_000
    good = json.dumps({"notebook_name": "04_evaluate", "status": "finished", "seconds": 3})
    files = {"good": (good, '{"headline": {"quality": 97.5}}'),
             "deep-metrics": (good, deep), "deep-inside": (good, '{"a": ' + deep + "}"),
             "deep-headline": (good, '{"headline": ' + "[" * 500 + "]" * 500 + "}"),
             "deep-run": ('{"notebook_name": "x", "attempts": ' + deep + "}", None)}
    for name, (run, metrics) in files.items():
        d = tmp_path / f"2026-12-01-{name}"
        d.mkdir()
        (d / "run.json").write_text(run)
        if metrics is not None:
            (d / "metrics.json").write_text(metrics)
    listed = {r["name"][11:]: r for r in runs.list_runs(tmp_path)}
    assert listed["good"]["status"] == "finished" and listed["good"]["metrics"] == {
        "quality": 97.5}
    for name in ("deep-metrics", "deep-inside", "deep-run"):
        assert listed[name]["status"] == "unreadable", name
        assert "nested too deeply" in listed[name]["problem"], listed[name]["problem"]
    assert listed["deep-headline"]["status"] == "unreadable"
    assert "field 'headline'" in listed["deep-headline"]["problem"]
    assert _cli("runs", "--root", str(tmp_path)) == 0
    table = capsys.readouterr().out
    assert "quality=97.5" in table and table.count("unreadable") == 4


# ----------------------------------------------------------------------------- C4

def test_loop_resume_with_other_parameters_is_refused_by_name(tiny_model_dir, tmp_path):
    """C4: resuming the loop with other THRESHOLDS / EVAL_PROBLEMS crashed deep in
    compare_curves (and loop_config.json was overwritten). Now the mismatch is named before
    anything changes; the update steps' budget may change; another model is refused too."""
    from rltlab.loop import LoopConfig, run_iteration, setup
    from rltlab.model.checkpoint import load_model

    cfg = LoopConfig(iterations=1, rollout_prompts=3, max_tokens=6, eval_problems=3,
                     thresholds=(0.3, 1.0), gate_steps=4, train_exit_predictor=False,
                     train_draft_head=False)
    run_dir = tmp_path / "loop"

    def load():
        model, tok, _ = load_model(tiny_model_dir, threads=1)
        return model, tok
    model, tok = load()
    run_iteration(setup(run_dir, model, tok, cfg, model_dir=tiny_model_dir), 0)
    (run_dir / ".iter_1.tmp-other").mkdir()          # as another execution's work in progress
    before = _snapshot(run_dir)

    changed = LoopConfig(**{**cfg.__dict__, "thresholds": (0.5, 1.0), "eval_problems": 4,
                            "gate_lr": 0.0, "iterations": 2})
    model, tok = load()
    with pytest.raises(ValueError) as err:       # rltlab.loop.ResumeMismatch
        setup(run_dir, model, tok, changed, model_dir=tiny_model_dir)
    message = str(err.value)
    assert "THRESHOLDS: [0.3, 1.0] in iteration(s) 0, [0.5, 1.0] now" in message
    assert "EVAL_PROBLEMS: 3 in iteration(s) 0, 4 now" in message
    assert "GATE_LR" not in message and "ITERATIONS" not in message
    assert f"--run-dir {run_dir} --start-over" in message
    assert _snapshot(run_dir) == before

    other = LoopConfig(**{**cfg.__dict__, "gate_lr": 0.0, "iterations": 2})
    model, tok = load()
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)
    with pytest.raises(ValueError, match="MODEL_DIR: the model .* is not the one"):
        setup(run_dir, model, tok, other, model_dir=tiny_model_dir)

    model, tok = load()
    state = setup(run_dir, model, tok, other, model_dir=tiny_model_dir)
    assert state.resumed_from == 1 and state.llm.get_weight_version() == 1
    assert (run_dir / "loop_config.json").read_bytes() == before["loop_config.json"]
