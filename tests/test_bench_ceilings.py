"""The engine bench's ceilings and gains (rltlab.bench.ceilings) against hand-computed values,
and the bench's W5 (groups) and W6/W7 (decode-heavy depth pair) run tiny on CPU (not timings)."""
import json
import statistics
from types import SimpleNamespace

import pytest

from rltlab.bench import ceilings
from rltlab.bench.models import build_model
from rltlab.bench.ceilings import ModelCosts
from rltlab.bench.engine import main as bench_main
from tiny_models import tiny_engine_model

COSTS = ModelCosts(rounds=4, linear_params=10, layer_bytes=20, head_params=5, head_bytes=10,
                   attn_flops_per_pair=8, kv_bytes_per_position=3)


def output(prompt_len, *depth_lists):
    return SimpleNamespace(prompt_token_ids=[1] * prompt_len, outputs=[
        SimpleNamespace(executed_depths=list(d)) for d in depth_lists])


def test_model_costs_of_the_tiny_model():
    costs = ModelCosts.of(tiny_engine_model(0))   # h32, i64, 2 layers, 4 heads, 2 kv, d8
    per_layer = 32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64
    assert costs == ModelCosts(
        rounds=4, linear_params=2 * per_layer, layer_bytes=4 * 2 * (per_layer + 4 * 32),
        head_params=61 * 32, head_bytes=4 * 61 * 32, attn_flops_per_pair=4 * 2 * 4 * 8,
        kv_bytes_per_position=2 * 2 * 2 * 8 * 4)


def test_prefill_flops_and_work_by_hand():
    # R x (2 x 10 x 3 + 8 x (1 + 2 + 3)) + 2 x 5 = 4 x 108 + 10
    assert ceilings.prefill_flops(COSTS, 3) == 442
    # one request, two samples: depths [4, 2, 3] and [4]; output token i >= 1 reads P + i keys
    work = ceilings.work_of(COSTS, [output(3, [4, 2, 3], [4])])
    assert work == dict(requests=1, prefill_tokens=3, prefill_flops=442, output_tokens=4,
                        decode_tokens=2, decode_row_rounds=5, kv_read_positions=2 * 4 + 3 * 5)
    assert ceilings.mean_executed_rounds(work) == 2.5


def test_shared_prompt_reads_count_once_per_group_step():
    """With shared-prefix attention (block 4) a group of three reads its prompt's whole blocks
    (8 of 10 positions) once per decode step, at its deepest member's rounds; the rest of each
    context per sample. n = 1 requests are unchanged."""
    group = output(10, [4, 2, 3, 1], [4, 4], [4, 1, 1])
    plain = ceilings.work_of(COSTS, [group])
    assert plain["kv_read_positions"] == (2 * 11 + 3 * 12 + 1 * 13) + 4 * 11 + (11 + 12)
    shared = ceilings.work_of(COSTS, [group], shared_block=4)
    # own parts: positions 8.. of each context; shared: steps 1, 2, 3 at depths 4, 3, 1
    own = (2 * 3 + 3 * 4 + 1 * 5) + 4 * 3 + (3 + 4)
    assert shared["kv_read_positions"] == own + 8 * (4 + 3 + 1)
    assert {k: v for k, v in shared.items() if k != "kv_read_positions"} == \
        {k: v for k, v in plain.items() if k != "kv_read_positions"}
    solo = output(10, [4, 2, 3])
    assert ceilings.work_of(COSTS, [solo], shared_block=4) == ceilings.work_of(COSTS, [solo])


def test_ceiling_by_hand():
    work = ceilings.work_of(COSTS, [output(3, [4, 2, 3], [4])])
    # prefill 442 FLOPs at 221 FLOP/s = 2 s; decode (5 x 20 + 2 x 10) / 2 rows + 23 x 3 = 129
    # bytes at 43 B/s = 3 s; 4 output tokens / 5 s; 2 decode tokens / 3 s
    limit = ceilings.ceiling(COSTS, work, rows=2, tflop_s=221e-12, copy_gb_s=43e-9)
    assert limit == pytest.approx({"prefill_floor_s": 2.0, "decode_floor_s": 3.0,
                                   "ceiling_tok_s": 0.8, "decode_ceiling_tok_s": 2 / 3})


def test_ideal_e2e_gain_and_depth_pair_by_hand():
    # (10 + 8) / (10 + 8 x 3 / 4) = 18 / 16
    assert ceilings.ideal_e2e_gain(10.0, 8.0, 3.0, 4.0) == pytest.approx(1.125)
    base_work = ceilings.work_of(COSTS, [output(3, [4] * 5)] * 2)        # 8 decode tokens, R
    cheap_work = ceilings.work_of(COSTS, [output(3, [4, 3, 3, 3, 3])] * 2)  # 3 rounds
    base = {"closed_loop": {"tok_s": 100.0, "work": base_work}, "prefill": {"wall_s": 10.0},
            "decode": {"decode_tok_s": 1.0}}   # 8 decode tokens at 1 tok/s: 8 s
    cheap = {"closed_loop": {"tok_s": 108.0, "work": cheap_work},
             "decode": {"decode_tok_s": 1.25}}
    pair = ceilings.depth_pair(base, cheap)
    # savings reached: (1.08 - 1) / (1.125 - 1) = 64%
    assert pair == {"e2e_gain": 1.08, "ideal_e2e_gain": 1.125, "pct_of_ideal_e2e": 64.0,
                    "decode_gain": 1.25, "prefill_s": 10.0, "decode_s": 8.0,
                    "base_rounds": 4.0, "cheap_rounds": 3.0}
    assert ceilings.depth_pair(base, {"error": "boom"}) is None


def test_annotate_by_hand():
    work = ceilings.work_of(COSTS, [output(3, [4, 2, 3], [4])])
    entry = {"modes": {"m": {
        "closed_loop": {"tok_s": 0.4, "work": work},
        "independent": {"tok_s": 0.2},
        "decode": {"decode_tok_s": 0.5, "work": work},
        "prefill": {"wall_s": 4.0, "work": work}}}}
    ceilings.annotate(entry, COSTS, rows=2, tflop_s=221e-12, copy_gb_s=43e-9)
    res = entry["modes"]["m"]
    assert res["prefill_pct_of_matmul"] == 50.0          # 442 FLOPs in 4 s at 221 FLOP/s
    assert res["decode"]["pct_of_ceiling"] == 75.0       # 0.5 of 2/3 tok/s
    assert res["ceiling_tok_s"] == 0.8 and res["pct_of_ceiling"] == 50.0   # closed loop
    assert res["independent"]["pct_of_ceiling"] == 25.0


def test_group_ideal_by_hand():
    grouped = ceilings.work_of(COSTS, [output(3, [4, 2, 3], [4])])
    # the same samples sent alone: the prompt prefilled twice, its K/V read by each
    independent = dict(grouped, prefill_flops=2 * grouped["prefill_flops"],
                       kv_read_positions=2 * grouped["kv_read_positions"])
    # grouped floor 2 + 3 = 5 s (test_ceiling_by_hand); independent: 884 FLOPs at 221 = 4 s,
    # (5 x 20 + 2 x 10) / 2 + 46 x 3 = 198 bytes at 43 B/s
    ideal = (4 + 198 / 43) / 5
    got = ceilings.group_ideal(COSTS, grouped, independent, rows=2, tflop_s=221e-12,
                               copy_gb_s=43e-9, speedup=1.36)
    assert got == {"ideal_group_gain": round(ideal, 3),
                   "group_pct_of_ideal": round(100 * 0.36 / (ideal - 1), 1)}
    assert ceilings.group_ideal(COSTS, grouped, grouped, 2, 221e-12, 43e-9, 1.2)[
        "group_pct_of_ideal"] is None   # nothing to save: no share


def test_bench_groups_and_decode_heavy_pair_run_tiny(capsys):
    res = bench_main(["--preset", "tiny", "--device", "cpu", "--workload", "W5", "W6", "W7",
                      "--scale", "0.02", "--modes", "gather", "--kv-gib", "0.05",
                      "--w5-rounds", "3", "--profile"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == res
    w5 = res["workloads"]["W5"]["modes"]["gather"]
    n = res["workloads"]["W5"]["spec"]["n"]
    assert w5["same_tokens"] == 1.0 and w5["group_speedup"] > 0   # fp32: identical samples
    # three paired rounds: the speedup is their median, with their mean and SE; the loops
    # reported are the last round's
    ratios = w5["round_speedups"]
    # round_speedups carry 4 decimals and group_speedup 3 of the unrounded median: compare
    # within both roundings (re-rounding 1.1495 gives 1.149 where the median gave 1.150)
    assert len(ratios) == 3
    assert w5["group_speedup"] == pytest.approx(statistics.median(ratios), abs=5.5e-4)
    assert w5["group_speedup_mean"] == pytest.approx(statistics.fmean(ratios), abs=1e-4)
    assert w5["group_speedup_se"] == pytest.approx(statistics.stdev(ratios) / 3 ** 0.5,
                                                   abs=1e-4)
    assert ratios[-1] == pytest.approx(w5["closed_loop"]["tok_s"] / w5["independent"]["tok_s"],
                                       rel=1e-3)
    assert set(w5["first_pass_tok_s"]) == {"closed_loop", "independent"}
    for loop in ("grouped_profile", "independent_profile"):   # --profile: one more loop each
        assert w5[loop]["wall_ms"] > 0 and w5[loop]["kernel_ms_by_class"]
    assert w5["ideal_group_gain"] > 1 and w5["group_pct_of_ideal"] is not None
    # stop-token ended lengths
    assert w5["stopped_fraction"] > 0 and w5["mean_output_tokens"] < res["workloads"]["W5"][
        "spec"]["max_tokens"]
    assert w5["independent"]["work"]["prefill_tokens"] == n * w5["closed_loop"]["work"][
        "prefill_tokens"]
    costs = ModelCosts.of(build_model(SimpleNamespace(model=None, preset="tiny", device="cpu",
                                                      dtype="float32")))
    for name in ("W5", "W6", "W7"):
        entry = res["workloads"][name]
        mode = entry["modes"]["gather"]
        limit = ceilings.ceiling(costs, mode["closed_loop"]["work"], entry["spec"]["concurrency"],
                                 res["matmul_tflop_s"], res["copy_bandwidth_gb_s"])
        assert mode["ceiling_tok_s"] == round(limit["ceiling_tok_s"], 1)
        assert mode["pct_of_ceiling"] == ceilings.pct(mode["closed_loop"]["tok_s"],
                                                      limit["ceiling_tok_s"])
        assert mode["prefill_pct_of_matmul"] > 0
    pair = res["depth_pairs"]["W7/W6"]["gather"]
    assert pair["cheap_rounds"] < pair["base_rounds"] == 4.0
    # recomputed from the pair's own printed inputs, which are rounded (rounds to 3 decimals):
    # equal to within that rounding, not to the last printed digit
    assert pair["ideal_e2e_gain"] == pytest.approx(ceilings.ideal_e2e_gain(
        pair["prefill_s"], pair["decode_s"], pair["cheap_rounds"], pair["base_rounds"]), abs=2e-3)


def test_bench_reports_windows_and_how_many_ran_a_plan_made_ahead(capsys):
    res = bench_main(["--preset", "tiny", "--device", "cpu", "--workload", "W6", "W7",
                      "--scale", "0.02", "--modes", "eager", "--kv-gib", "0.05"])
    for workload, kind in (("W7", "round_windows"), ("W6", "token_windows")):
        windows = res["workloads"][workload]["modes"]["eager"][kind]
        assert windows["windows"] > 1 and 0 < windows["prepared_used"] < windows["windows"]


def run_tiny_w7_mode():
    """bench.engine.run_mode on a 2% W7 with the tiny model, eager mode -> (spec, result)."""
    from rltlab.bench import engine as bench_engine

    model = build_model(SimpleNamespace(model=None, preset="tiny", device="cpu", dtype="float32"))
    spec = bench_engine.scaled(bench_engine.WORKLOADS["W7"], 0.02)
    prompts = bench_engine.random_prompts(spec["requests"], spec["prompt_len"],
                                       model.config.vocab_size, seed=7)
    params = bench_engine.workload_params(spec, model.config.num_rounds, spec["requests"],
                                          model.config.vocab_size)
    return spec, bench_engine.run_mode(model, spec, "eager", prompts, params, 0.05,
                                       ModelCosts.of(model))


def test_run_mode_leaves_no_engine_alive_for_the_next_mode(monkeypatch):
    """Each mode's KV cache must be freed before the next mode allocates its own (a leaked
    cache that filled the GPU made every later mode fail with out-of-memory)."""
    import weakref

    from rltlab.engine import LLM

    engines = []
    real_init = LLM.__init__

    def recording_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        engines.append(weakref.ref(self.llm_engine))

    monkeypatch.setattr(LLM, "__init__", recording_init)
    _, result = run_tiny_w7_mode()
    assert result["round_windows"]["windows"] > 0   # the path that once kept the engine alive
    assert len(engines) == 1 and engines[0]() is None


def test_run_mode_reports_the_closed_loop_after_a_first_pass(monkeypatch):
    """The reported closed loop is the second on the engine: the first (kept apart as
    closed_loop_first_pass) pays the one-off captures and compiles its tail reaches."""
    from rltlab.bench import engine as bench_engine

    loops = []
    real_closed_loop = bench_engine.engine_checks.closed_loop

    def recording_closed_loop(llm, prompts, params, concurrency, costs):
        figures, outputs = real_closed_loop(llm, prompts, params, concurrency, costs)
        loops.append((figures, len(prompts), params[0].max_tokens))
        return figures, outputs

    monkeypatch.setattr(bench_engine.engine_checks, "closed_loop", recording_closed_loop)
    spec, result = run_tiny_w7_mode()
    full = [figures for figures, n, max_tokens in loops
            if n == spec["requests"] and max_tokens == spec["max_tokens"]]
    assert len(full) == 2   # then the prefill-only loop (max_tokens 1)
    assert result["closed_loop_first_pass"] is full[0] and result["closed_loop"] is full[1]
    assert full[0]["tokens"] == full[1]["tokens"] == spec["requests"] * spec["max_tokens"]


@pytest.mark.parametrize("prefill_first", [False, True])
def test_decode_phase_counts_only_tokens_made_after_every_first_token(prefill_first):
    """With prompts prefilled over several steps, rows that got their first token early decode
    beside the later prefills unless prefill first holds them: those tokens come before the
    decode phase's timing starts and must not be counted in its tok/s."""
    from rltlab.bench import engine as bench_engine
    from rltlab.engine import LLM

    model = build_model(SimpleNamespace(model=None, preset="tiny", device="cpu", dtype="float32"))
    spec = dict(concurrency=6, requests=6, prompt_len=24, max_tokens=10, replay=True)
    prompts = bench_engine.random_prompts(6, 24, model.config.vocab_size, seed=3)
    params = bench_engine.workload_params(spec, model.config.num_rounds, 6,
                                          model.config.vocab_size)
    # two prompts per step: the last rows reach their first token several steps after the first
    llm = LLM(model, decode_path="static", max_num_seqs=6, max_num_batched_tokens=48,
              prefill_chunk=24, kv_cache_memory_gib=0.05, prefill_first=prefill_first)
    figures = bench_engine.decode_phase(llm, prompts, params, ModelCosts.of(model))
    every_token_but_the_first = 6 * (spec["max_tokens"] - 1)
    if prefill_first:
        assert figures["decode_tokens"] == every_token_but_the_first
    else:
        assert 0 < figures["decode_tokens"] < every_token_but_the_first


def test_the_cpu_matmul_ceiling_is_the_best_of_several_timings(monkeypatch):
    """One slow timing (a busy core) must not set the ceiling: it once came out 50x low and
    bench.paired printed prefill at 4,500% of it."""
    import torch
    timings = iter([0.05, 0.001, 0.002, 0.003, 0.004])
    monkeypatch.setattr(ceilings, "device_seconds", lambda fn, device, repeats: next(timings))
    assert ceilings.matmul_tflop_s("cpu", torch.float32, size=100) == \
        ceilings.significant(2 * 100 ** 3 / 0.001 / 1e12)


def test_off_cuda_the_default_modes_leave_out_the_graph_modes(capsys):
    """Without CUDA, graph and compile would time the eager path again under their own names
    (each row said "timed": "eager"): the default is plain and eager there. An unknown mode is
    a usage error."""
    res = bench_main(["--preset", "tiny", "--device", "cpu", "--workload", "W1",
                      "--scale", "0.02", "--kv-gib", "0.05"])
    assert sorted(res["workloads"]["W1"]["modes"]) == ["eager", "plain"]
    with pytest.raises(SystemExit) as stop:
        bench_main(["--preset", "tiny", "--device", "cpu", "--modes", "eager,warp"])
    assert stop.value.code == 2 and "unknown modes ['warp']" in capsys.readouterr().err
