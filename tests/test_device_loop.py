"""EngineConfig.device_loop (rltlab.engine.device_loop): the device's own loop over a request's
tree programs decides what TreeGraph.run's host loop decides. Without CUDA graphs its decide
step and programs run eagerly, so these tests check the rules on the CPU: target-only tokens,
the host recompute's statistics, the host loop's program count, and the fall-back."""
import pytest
import torch

from rltlab.engine import EngineConfig, TreeProposer
from rltlab.engine import device_loop
from rltlab.engine.tree_program import TreeProgram
from tree_oracle import (TREE, Oracle, expected_stats, greedy, make_engine, token_lists,
                         tree_model, tree_prompts)


@pytest.fixture(scope="module")
def model():
    return tree_model()


@pytest.fixture(scope="module")
def prompts():
    return tree_prompts()


def _run(model, prompt, proposer, params, loop: bool, pipeline: int, monkeypatch):
    """-> (output, programs run, the tree's device-loop runs) of one request."""
    programs, body = [0], TreeProgram._program

    def counted(program):
        programs[0] += 1
        return body(program)
    monkeypatch.setattr(TreeProgram, "_program", counted)
    llm = make_engine(model, proposer, spec_pipeline=pipeline, block_size=6, device_loop=loop)
    out = llm.generate([prompt], params)[0]
    monkeypatch.setattr(TreeProgram, "_program", body)
    return out, programs[0], llm.spec_graphs[id(proposer)].device_loop_runs


@pytest.mark.parametrize("ranks", [(0, 0, 0, 0), (9, 9, 9, 9)])
@pytest.mark.parametrize("rule, first", [(False, False), (True, False), ("agree", True)])
@pytest.mark.parametrize("pipeline", [3, 16])
def test_device_loop_decides_what_the_host_loop_decides(model, prompts, ranks, rule, first,
                                                        pipeline, monkeypatch):
    """Tokens equal target-only's, iterations / acceptances / verified nodes equal the host
    recompute of the rules, and as many programs run as with the host loop (none past a stop
    token, EOS, max_tokens or spec_pipeline), with the loop taking every request's steps of
    more than one launch."""
    for params in (greedy(24), greedy(13)):
        target = token_lists(make_engine(model, block_size=6).generate(prompts, params))
        for prompt, out in zip(prompts, target):
            oracle = Oracle(out, ranks)
            runs = {}
            for loop in (False, True):
                proposer = TreeProposer(oracle, TREE, lookup=3, ngram=2, adaptive_lookup=rule,
                                        first_drafts=first)
                runs[loop] = _run(model, prompt, proposer, params, loop, pipeline, monkeypatch)
            (host, host_programs, _), (dev, dev_programs, dev_runs) = runs[False], runs[True]
            assert token_lists([dev]) == [out]
            stats = dev.outputs[0].spec_stats
            assert (stats["steps"], stats["accepted"], stats["drafted"]) == expected_stats(
                oracle, out, params.max_tokens, TREE, prompt, 3, 2, rule, 1, first)
            assert stats == host.outputs[0].spec_stats
            assert dev_programs == host_programs
            assert dev_runs >= 1


def test_stop_tokens_end_the_device_loop_and_too_many_take_the_host_loop(model, prompts,
                                                                          monkeypatch):
    """A stop token ends the loop where the host loop ends (drafts that never match: one token
    a program); more stop tokens than the device compares (MAX_STOPS) leave the request to
    the host loop."""
    prompt = prompts[0]
    out = token_lists(make_engine(model, block_size=6).generate([prompt], greedy(24)))[0]
    later = [t for i, t in enumerate(out) if i >= 4 and t not in out[:i]]   # first seen late
    many = [t for t in range(1, 200) if t not in out][:device_loop.MAX_STOPS] + later[:1]
    assert len(later) >= 2, out
    for stops, loop_runs in (([later[0]], True), ([later[-1], later[0]], True), (many, False)):
        params = greedy(24, stop_token_ids=stops)
        expected = token_lists(make_engine(model, block_size=6).generate([prompt], params))
        runs = {loop: _run(model, prompt, TreeProposer(Oracle(out, (9, 9, 9, 9)), TREE),
                           params, loop, 16, monkeypatch) for loop in (False, True)}
        assert token_lists([runs[True][0]]) == expected
        assert runs[True][1] == runs[False][1]
        assert (runs[True][2] > 0) == loop_runs, stops


@pytest.mark.parametrize("error, reason", [
    (device_loop.DeviceLoopUnavailable("nvcc not found (test)"), "nvcc not found (test)"),
    (RuntimeError("nvcc not found (driver)"),
     "building it raised RuntimeError: nvcc not found (driver)")])
def test_a_loop_that_cannot_be_built_leaves_the_host_loop_with_a_warning(model, prompts, error,
                                                                          reason, monkeypatch):
    """The reason is kept and warned about once, whatever the build raised (the loop is
    untried on most GPUs and drivers), and the request runs on the host loop."""
    def refuse(self, tree, programs, capacity):
        raise error
    monkeypatch.setattr(device_loop.DeviceLoop, "__init__", refuse)
    out = token_lists(make_engine(model, block_size=6).generate(prompts[:1], greedy(24)))[0]
    proposer = TreeProposer(Oracle(out, (0, 0, 0, 0)), TREE)
    llm = make_engine(model, proposer, block_size=6, device_loop=True)
    with pytest.warns(UserWarning, match=r"device_loop: the host loop runs instead \(" +
                      reason.replace("(", r"\(").replace(")", r"\)")):
        assert token_lists(llm.generate(prompts[:1], greedy(24))) == [out]
    tree = llm.spec_graphs[id(proposer)]
    assert not tree.device_loop and tree.device_loop_error == reason
    assert tree.device_loop_runs == 0


def test_native_library_names_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(device_loop, "_native", None)
    monkeypatch.setattr(device_loop.shutil, "which", lambda name: None)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    for _ in range(2):   # the reason is kept: no second search
        with pytest.raises(device_loop.DeviceLoopUnavailable, match="nvcc not found"):
            device_loop.native_library()
    with pytest.raises(ValueError, match="device_loop must be a bool"):
        EngineConfig(device_loop="yes")


def _decided(span=3, n=1, path=(5, 6, 7), bonus=8, finite=1, live=1, hits=0, left=4,
             stops=frozenset({6}), launches=4, adaptive="agree") -> tuple[int, int, list]:
    """The decide step alone on a program output row -> (go on, next rows, the ring's row)."""
    from types import SimpleNamespace
    row = [n, *path, bonus, finite, live, hits]
    lead = SimpleNamespace(out=torch.tensor(row + [-5] * 3), width=span + 5,
                           index=torch.tensor([9, 9, left, 9, 9]),
                           static=SimpleNamespace(cuda_graphs=False))
    tree = SimpleNamespace(proposer=SimpleNamespace(span=span, adaptive_lookup=adaptive))
    loop = device_loop.DeviceLoop(tree, {True: lead}, capacity=8)
    loop.limit.fill_(launches)
    loop.stops[: len(stops)] = torch.tensor(sorted(stops))
    loop._decide()
    return int(loop.flags[0]), int(loop.flags[1]), loop.row(0)


def test_decide_reads_only_the_emitted_tokens_and_the_rules_inputs():
    """go: live, finite, tokens left, no stop token among the n accepted path tokens and the
    bonus (a stop token past n was never emitted), under the launch limit; rows: hits > 0
    under an adaptive rule, always otherwise. The row reaches the host as written."""
    assert _decided() == (1, 0, [1, 5, 6, 7, 8, 1, 1, 0])
    assert _decided(n=2)[0] == 0                     # the stop token 6 emitted
    assert _decided(bonus=6)[0] == 0
    assert _decided(n=0, path=(6, 6, 6))[0] == 1
    assert _decided(live=0)[0] == 0 and _decided(finite=0)[0] == 0
    assert _decided(left=0)[0] == 0 and _decided(launches=1)[0] == 0
    assert _decided(launches=2)[0] == 1
    assert _decided(hits=2)[1] == 1 and _decided(adaptive=False)[1] == 1
