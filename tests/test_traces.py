"""Trace collection through the engine's observer hook, storage round trip, corruption checks."""
import json

import pytest
import torch
from torch.utils.data import DataLoader

from rltlab.model import gates
from rltlab.engine import LLM, SamplingParams
from rltlab.traces import (ALL_FIELDS, TraceCorruptError, TraceDataset, TraceWriter,
                           collect_traces, collection_overhead, load_projection, load_traces,
                           read_manifest, round_stats, verify_traces)
from tiny_models import tiny_engine_model

torch.set_num_threads(1)
R = 4
PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]


@pytest.fixture(scope="module")
def model():
    return tiny_engine_model(0)


def params(**kw):
    base = dict(temperature=0.0, max_tokens=6, exit_threshold=0.3, min_loops=1,
                ignore_eos=True, seed=7)
    return SamplingParams(**{**base, **kw})


def _records(n, dim=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        rec = {k: torch.rand(R, generator=gen) for k in ("gate_logit", "hazard", "cdf",
               "top1_prob", "margin", "entropy", "logprob_ref", "kl_ref")}
        rec.update(hidden=torch.randn(R, dim, generator=gen), round_mask=torch.ones(R, dtype=bool),
                   top1_id=torch.randint(0, 50, (R,), generator=gen), executed=R, selected=2,
                   ref_round=R, ref_token=i, token=i, position=10 + i, output_index=i + 1,
                   prompt_id=i // 3, sample_index=0, weight_version=5, seed=2 ** 40 + i)
        out.append(rec)
    return out


def test_storage_round_trip_and_dataset(tmp_path):
    recs = _records(10)
    writer = TraceWriter(tmp_path, num_rounds=R, hidden_dim=3, shard_tokens=4)
    writer.add(recs[:7])
    writer.add(recs[7:])
    manifest = writer.close()
    assert [s["num_tokens"] for s in manifest["shards"]] == [4, 4, 2]
    assert manifest["num_tokens"] == 10 and set(manifest["fields"]) == set(ALL_FIELDS)
    loaded = load_traces(tmp_path)
    assert torch.equal(loaded["hidden"], torch.stack([r["hidden"] for r in recs]))
    assert torch.equal(loaded["entropy"], torch.stack([r["entropy"] for r in recs]))
    assert loaded["seed"].tolist() == [2 ** 40 + i for i in range(10)]
    assert verify_traces(tmp_path) == {"shards": 3, "num_tokens": 10}

    ds = TraceDataset(tmp_path, fields=["hidden", "token"])
    items = list(ds)
    assert len(items) == len(ds) == 10 and [int(x["token"]) for x in items] == list(range(10))
    batches = list(DataLoader(TraceDataset(tmp_path, shuffle=True, seed=1), batch_size=4))
    assert sum(b["token"].shape[0] for b in batches) == 10
    assert sorted(torch.cat([b["token"] for b in batches]).tolist()) == list(range(10))
    with pytest.raises(ValueError, match="unknown trace fields"):
        TraceDataset(tmp_path, fields=["nope"])

    # Appending with the same settings continues the shard numbering; other settings refuse.
    writer = TraceWriter(tmp_path, num_rounds=R, hidden_dim=3, shard_tokens=4)
    writer.add(_records(2, seed=1))
    assert writer.close()["shards"][-1]["file"] == "shard-00003.safetensors"
    with pytest.raises(ValueError, match="other settings"):
        TraceWriter(tmp_path, num_rounds=R, hidden_dim=5)


def test_corrupt_truncated_missing_shards(tmp_path):
    writer = TraceWriter(tmp_path, num_rounds=R, hidden_dim=3, shard_tokens=4)
    writer.add(_records(8))
    writer.close()
    shard = tmp_path / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())

    data[-5] ^= 0xFF  # one flipped bit-pattern in the payload, same size
    shard.write_bytes(bytes(data))
    with pytest.raises(TraceCorruptError, match="shard-00001.*sha256.*corrupt"):
        load_traces(tmp_path)
    it = iter(TraceDataset(tmp_path))
    assert int(next(it)["token"]) == 0     # the intact first shard streams ...
    with pytest.raises(TraceCorruptError, match="shard-00001"):
        list(it)                           # ... and the corrupt one stops the stream

    shard.write_bytes(bytes(data[:-100]))  # truncated
    with pytest.raises(TraceCorruptError, match="shard-00001.*truncated"):
        verify_traces(tmp_path)
    shard.unlink()
    with pytest.raises(TraceCorruptError, match="missing"):
        list(TraceDataset(tmp_path))


def _recompute(model, prompt, token_ids, exit_depths=None):
    ids = prompt + token_ids[:-1]
    kwargs = {}
    if exit_depths is not None:
        kwargs["exit_rounds"] = torch.tensor([[R] * len(prompt) + exit_depths[1:]])
    with torch.no_grad():
        out = model(torch.tensor([ids]), all_logits=True, **kwargs)
    return out


def test_teacher_mode_records_all_rounds_and_stats_match_recompute(model, tmp_path):
    llm = LLM(model)
    p = params()
    outs, manifest = collect_traces(llm, PROMPTS, p, tmp_path, teacher=True,
                                    prompt_ids=[10, 11, 12])
    tr = load_traces(tmp_path)
    n = sum(len(o.token_ids) - 1 for o in outs)
    assert tr["token"].shape[0] == n == manifest["num_tokens"]
    assert tr["round_mask"].all() and (tr["executed"] == R).all()
    assert all(o.exit_depths == [R] * len(o.token_ids) for o in outs)  # full-depth rollout
    assert set(tr["prompt_id"].tolist()) == {10, 11, 12}
    assert (tr["weight_version"] == 0).all() and (tr["seed"] == 7).all()
    assert manifest["info"]["teacher"] is True and "0" in manifest["info"]["model_hashes"]
    # `selected` is the stock Q-exit applied to the recorded gate logits of all R rounds.
    expected = gates.q_exit_rounds(tr["gate_logit"], p.exit_threshold, p.min_loops)
    assert torch.equal(tr["selected"].long(), expected)
    assert (tr["selected"] < R).any()  # the test would be vacuous otherwise

    for k, (prompt, out) in enumerate(zip(PROMPTS, outs)):
        rows = (tr["prompt_id"] == 10 + k).nonzero().squeeze(-1)
        rows = rows[tr["output_index"][rows].argsort()]
        assert tr["output_index"][rows].tolist() == list(range(1, len(out.token_ids)))
        assert tr["token"][rows].tolist() == out.token_ids[1:]
        assert tr["position"][rows].tolist() == [len(prompt) + i - 1
                                                 for i in range(1, len(out.token_ids))]
        ref = _recompute(model, prompt, out.token_ids)
        P = len(prompt)
        for j, row in enumerate(rows.tolist()):
            pos = P + j  # input position of output token j + 1
            h = torch.stack([ref.hidden_states[r][0, pos] for r in range(R)])
            torch.testing.assert_close(tr["hidden"][row], h, atol=1e-5, rtol=1e-4)
            logits = torch.stack([ref.logits[r][0, pos] for r in range(R)])
            stats = round_stats(logits, ref.gate_logits[0, pos])
            for name in ("gate_logit", "hazard", "cdf", "top1_prob", "margin", "entropy",
                         "logprob_ref", "kl_ref"):
                torch.testing.assert_close(tr[name][row], stats[name], atol=2e-5, rtol=1e-4)
            assert tr["top1_id"][row].tolist() == stats["top1_id"].tolist()
            # greedy teacher: the emitted token is the round-R argmax
            assert int(tr["ref_token"][row]) == int(stats["ref_token"]) == out.token_ids[j + 1]
            # direct formulas for two of them
            logp = torch.log_softmax(logits, -1)
            kl = (logp[-1].exp() * (logp[-1] - logp)).sum(-1)
            torch.testing.assert_close(tr["kl_ref"][row], kl, atol=2e-5, rtol=1e-4)
            ent = -(logp.exp() * logp).sum(-1)
            torch.testing.assert_close(tr["entropy"][row], ent, atol=2e-5, rtol=1e-4)


def test_policy_mode_and_projection(model, tmp_path):
    llm = LLM(model)
    outs, manifest = collect_traces(llm, PROMPTS[:2], params(), tmp_path, projection_dim=8,
                                    projection_seed=3, hidden_dtype="bfloat16")
    tr = load_traces(tmp_path)
    proj = load_projection(tmp_path)
    assert proj.shape == (32, 8) and manifest["projection"]["seed"] == 3
    assert tr["hidden"].dtype == torch.bfloat16 and tr["hidden"].shape[1:] == (R, 8)
    for k, (prompt, out) in enumerate(zip(PROMPTS[:2], outs)):
        rows = (tr["prompt_id"] == k).nonzero().squeeze(-1)
        rows = rows[tr["output_index"][rows].argsort()]
        assert tr["executed"][rows].tolist() == out.exit_depths[1:]
        assert tr["selected"][rows].tolist() == out.exit_depths[1:]
        ref = _recompute(model, prompt, out.token_ids, out.exit_depths)
        for j, row in enumerate(rows.tolist()):
            e = out.exit_depths[j + 1]
            assert tr["round_mask"][row].tolist() == [r < e for r in range(R)]
            h = torch.stack([ref.hidden_states[r][0, len(prompt) + j] for r in range(e)])
            torch.testing.assert_close(tr["hidden"][row, :e].float(), (h @ proj),
                                       atol=2e-2, rtol=2e-2)
            assert (tr["hidden"][row, e:] == 0).all()
            assert tr["ref_round"][row] == e
    assert json.loads((tmp_path / "manifest.json").read_text())["num_tokens"] == len(tr["token"])


def test_collection_overhead_report(model, tmp_path):
    llm = LLM(model)
    report = collection_overhead(llm, PROMPTS[:2], params(max_tokens=4), tmp_path / "ovh")
    assert report["output_tokens"] == 8 and report["plain_s"] > 0 and report["traced_s"] > 0
    assert report["overhead_x"] == pytest.approx(report["traced_s"] / report["plain_s"])
    split = report["traced_split_s"]   # where the traced run's host time went
    assert set(split) == {"open", "generate", "observe", "write", "close"}
    assert all(v >= 0 for v in split.values()) and split["write"] > 0 and split["observe"] > 0
    assert split["observe"] + split["write"] <= split["generate"] <= report["traced_s"]
    assert set(report["host_pauses"]) == {"plain", "traced"}
    assert all(p["gc_collections"] >= 0 and 0 <= p["gc_s"] <= report[f"{run}_s"]
               and p["graphs_captured"] == 0 for run, p in report["host_pauses"].items())
    assert not any(tmp_path.iterdir())   # nothing left behind
    assert read_manifest  # exported


def test_collection_overhead_profiles_both_runs_when_asked(model, tmp_path):
    """profile=True adds one profiled plain and one profiled traced run; the traced run's
    device work (the CPU's operators here) includes what collection adds, and its temporary
    traces are removed like the timed runs'."""
    llm = LLM(model)
    report = collection_overhead(llm, PROMPTS[:2], params(max_tokens=4), tmp_path / "ovh",
                                 profile=True)
    plain, traced = report["profile"]["plain"], report["profile"]["traced"]
    assert plain["wall_ms"] > 0 and traced["wall_ms"] > 0
    assert traced["launches"] > plain["launches"]
    # and under cProfile: the traced run's host functions include the collector's own
    hosts = report["profile"]["plain_host"], report["profile"]["traced_host"]
    assert all(h["wall_ms"] > 0 and h["functions"] for h in hosts)
    assert all(len(row) == 4 and row[2] <= row[3] + 1e-6 for h in hosts for row in h["functions"])
    assert not any(tmp_path.iterdir())
    assert "profile" not in collection_overhead(llm, PROMPTS[:2], params(max_tokens=4),
                                                tmp_path / "ovh")


def test_collection_overhead_counts_graph_captures_in_the_timed_runs(model, tmp_path,
                                                                     monkeypatch):
    """A CUDA graph captured inside a timed run is one-off work the warm-ups missed: reported
    on that run's side (here a traced generate that 'captures' one graph each call)."""
    from rltlab.engine.static_decode import CAPTURE_STATS
    from rltlab.traces import collect

    generate = collect.TraceCollector.generate

    def capturing_generate(self, *args, **kwargs):
        CAPTURE_STATS["graphs"] += 1
        CAPTURE_STATS["seconds"] += 0.25
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(collect.TraceCollector, "generate", capturing_generate)
    monkeypatch.setitem(CAPTURE_STATS, "graphs", CAPTURE_STATS["graphs"])
    monkeypatch.setitem(CAPTURE_STATS, "seconds", CAPTURE_STATS["seconds"])
    report = collection_overhead(LLM(model), PROMPTS[:2], params(max_tokens=3), tmp_path / "o")
    assert report["host_pauses"]["traced"]["graphs_captured"] == 1
    assert report["host_pauses"]["traced"]["capture_s"] == pytest.approx(0.25)
    assert report["host_pauses"]["plain"]["graphs_captured"] == 0
