"""Replayed acceptance: tree speculation's SYSTEM cost at the Ouro-1.4B shape, measured end to
end against target-only decoding in the same run (issue 60, items 5 and 6).

A random-weight 1.4B-shape model accepts nothing a drafter proposes, and the embedded 6.1M
model is too small to show what the 1.4B shape costs. So:

 1. record: the embedded model (artifacts/ouro-tiny, fp32) decodes the held-out text and
    arithmetic prompts (rltlab.draft_heads.evaluate.eval_prompts: the full set, half of each
    kind) at each temperature with a TreeProposer (its lookahead heads' tree and a prompt-lookup
    chain) through the generic tree verifier (rltlab.engine.spec.tree_verify); every
    iteration's tree shape (parent indices) and accepted nodes are recorded per request, and
    every output length;
 2. replay: an engine on a random-weight model of --preset (bf16 on CUDA) decodes the same
    prompts to the same lengths (ignore_eos) at concurrency c, once target-only and once with
    a proposer that proposes each recorded tree shape again (random tokens) and forces its
    recorded acceptance (DraftTree.replay_accept): every row, round, LM head, acceptance
    computation, K/V commit and host turn of the real verifier runs, only the outcome is
    imposed. Paired repeats, each side timed between device syncs after untimed warm-ups;
    speculation is never switched off here (spec_max_concurrency unlimited), so the ratio at
    every c says where it stops paying;
 3. program costs (--program-costs): at c = 1, one verification of a 5-, 16- and 37-row tree
    (the heads' chain of 4; that chain beside a lookup chain of 10; the shipped 16-node tree)
    in target-token units (target-only decoding's per-token wall time in the same run): the
    generic verifier's whole step, its device launch alone (R rounds over the rows), and the
    TreeProposer's device program (greedy, c = 1); beside each, what its bytes (the shared
    weights read once per round, the LM head, K/V) and FLOPs allow at the device's measured
    copy bandwidth and matmul rate (rltlab.bench.ceilings); on CUDA, the program's heaviest
    kernels run eagerly (torch.profiler), to name where its cost above the roofline goes.

The speedups are labelled "replayed acceptance": they measure the system's cost at the shape
with acceptance recorded on the embedded model, not a drafter's quality on Ouro-1.4B.

    python -m rltlab.bench.spec_replay --device cuda --program-costs          # ~5 min, H200
    python -m rltlab.bench.spec_replay --device cpu --preset tiny --prompts 4 --max-tokens 8 \\
        --concurrency 1 2 --repeats 2 --program-costs --rows 5 16 --cost-tokens 8   # smoke

Last line: JSON (program_cost_target_tokens, replayed_speedup, commit, hardware, dtype, ...);
--out is written after the replay too (finished: false), so a run stopped in the program
costs keeps the replay.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import time
from collections import deque

import torch

from rltlab.bench.ceilings import ModelCosts, copy_bandwidth, matmul_tflop_s
from rltlab.bench.engine_checks import kernel_profile, sync
from rltlab.common.atomic import write_json_atomic
from rltlab.common.device import add_device_argument
from rltlab.common.environment import environment, git_commit
from rltlab.engine.spec.protocol import DraftTree

LABEL = "replayed acceptance (embedded model's recorded acceptance forced through the real " \
        "kernels at the preset's shape; system cost, not a drafter's quality there)"
UNLIMITED = 1 << 30


# --------------------------------------------------------------------------------- record
class Recorder:
    """A Proposer around another that records, per request, its iterations: (tree parents,
    accepted nodes) and ("plain", n) for tokens emitted by steps that did not speculate."""

    def __init__(self, inner):
        self.inner, self.log, self._next_len = inner, {}, {}

    def propose(self, states):
        for s in states:
            seen = self._next_len.get(s.key)
            if seen is not None and len(s.token_ids) > seen:
                self.log[s.key].append(("plain", len(s.token_ids) - seen))
        trees = self.inner.propose(states)
        self._trees = {s.key: t for s, t in zip(states, trees)}
        self._lens = {s.key: len(s.token_ids) for s in states}
        return trees

    def observe(self, state, verdict):
        tree = self._trees.get(state.key)
        parents = list(tree.parents) if tree is not None else []
        self.log.setdefault(state.key, []).append((parents, list(verdict.accepted)))
        self._next_len[state.key] = self._lens[state.key] + len(verdict.tokens)
        self.inner.observe(state, verdict)


def add_proposer_arguments(ap: argparse.ArgumentParser, max_tokens: int) -> None:
    """The recording model, its TreeProposer and its prompt set (also bench.spec_e2e's)."""
    from rltlab.bench.tree_spec import HEADS
    ap.add_argument("--model", default=None, help="the recording model (default: the embedded "
                    "artifacts/ouro-tiny)")
    ap.add_argument("--heads", default=HEADS, help="its lookahead heads (default: the shipped)")
    ap.add_argument("--tree", choices=("chain", "shipped"), default="chain",
                    help="the heads' tree: their rank-0 chain or the shipped tree")
    ap.add_argument("--lookup", type=int, default=10, help="prompt-lookup chain beside it")
    ap.add_argument("--prompts", type=int, default=128,
                    help="held-out prompts, half arithmetic, half text (eval_prompts)")
    ap.add_argument("--max-tokens", type=int, default=max_tokens)


def load_tree(args, model) -> tuple:
    """(lookahead heads of args.heads on the model's device, the tree args.tree names)."""
    from rltlab.draft_heads import lookahead
    heads, shipped_tree, _ = lookahead.load(args.heads, model)
    return heads, (shipped_tree if args.tree == "shipped" else
                   [(0,) * j for j in range(1, heads.depth + 1)])


def tree_blocks(tree, lookup: int, concurrency: int, max_len: int) -> int:
    """KV blocks (of 16) for `concurrency` sequences of max_len tokens and the forks of every
    leaf of the tree and its lookup chain (two per leaf), so that no tree is pruned."""
    leaves = sum(1 for p in tree if not any(q[:-1] == p for q in tree)) + bool(lookup)
    return concurrency * (-(-max_len // 16) + 2 * leaves) + 16


def record(args) -> dict:
    """Decode the prompt set on the embedded model with its heads; -> {temperature: [request
    {prompt, kind, length, items}]} and the recording's tau per temperature and kind."""
    from rltlab.draft_heads.evaluate import eval_prompt_kinds, eval_prompts
    from rltlab.engine import LLM, SamplingParams, TreeProposer
    from rltlab.engine.spec.tree_drafts import TreeDrafts
    from rltlab.model.checkpoint import load_model
    model, tok, md = load_model(args.model, dtype="float32", device=args.device)
    prompts = eval_prompts(tok, md, args.prompts)
    kinds = eval_prompt_kinds(args.prompts)
    eos = getattr(tok, "eos_token_id", None)
    out = {}
    max_len = max(map(len, prompts)) + args.max_tokens + 1
    heads, tree = load_tree(args, model)
    for temperature in args.temperatures:
        recorder = Recorder(TreeDrafts(TreeProposer(heads, tree, lookup=args.lookup)))
        # speculation at every concurrency: a switch-off (CUDA's default above 8 sequences)
        # would leave the tokens of the steps without it out of the recording
        llm = LLM(model, max_num_seqs=args.record_concurrency, block_size=16,
                  max_model_len=max_len, spec_max_concurrency=UNLIMITED, num_blocks=tree_blocks(
                      tree, args.lookup, args.record_concurrency, max_len))
        llm.set_proposer(recorder)
        params = [SamplingParams(temperature=temperature, max_tokens=args.max_tokens, seed=i,
                                 exit_policy="fixed", ignore_eos=args.ignore_eos)
                  for i in range(len(prompts))]
        outs = llm.generate(prompts, params)
        requests = []
        for i, (prompt, kind, res) in enumerate(zip(prompts, kinds, outs)):
            items = recorder.log.get((res.request_id, 0), [])
            # the tokens the iterations emitted, the last one's in full where a stop cut it:
            # what the replay decodes (to the same length on both sides)
            length = 1 + sum(it[1] if it[0] == "plain" else len(it[1]) + 1 for it in items)
            stopped_at = len(res.outputs[0].token_ids)
            if length < stopped_at:   # plain steps after the last proposal (Recorder sees none)
                items = items + [("plain", stopped_at - length)]
                length = stopped_at
            requests.append({"prompt": list(prompt), "kind": kind, "length": length,
                             "stopped_at": stopped_at, "items": items})
        out[temperature] = requests
    del model
    return {"requests": out, "eos": eos, "tree": [list(p) for p in tree],
            "tau": {str(t): _recorded_tau(r) for t, r in out.items()}}


def _replay_tau(requests: list[dict]) -> float:
    """The tokens per iteration a faithful replay of these requests shows: every recorded
    iteration's, and each plain token as an iteration of one (the replay verifies it alone)."""
    steps = sum(it[1] if it[0] == "plain" else 1 for r in requests for it in r["items"])
    tokens = sum(r["length"] - 1 for r in requests)
    return tokens / max(steps, 1)


def _recorded_tau(requests: list[dict]) -> dict:
    """Tokens per speculative iteration, over all requests and per kind."""
    def tau(reqs):
        its = [it for r in reqs for it in r["items"] if it[0] != "plain"]
        return sum(len(acc) + 1 for _, acc in its) / max(len(its), 1)
    kinds = sorted({r["kind"] for r in requests})
    return {"all": tau(requests), **{k: tau([r for r in requests if r["kind"] == k])
                                     for k in kinds}}


# --------------------------------------------------------------------------------- replay
class Replay:
    """The replay proposer: request id -> the recorded items, proposed again in order with
    random tokens and the recorded acceptance forced (DraftTree.replay_accept)."""

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab, self.queues = vocab, {}
        self._gen = torch.Generator().manual_seed(seed)
        self._pool = torch.randint(1, vocab, (4096,), generator=self._gen).tolist()
        self._at = 0

    def load(self, request_id: str, items: list) -> None:
        self.queues[request_id] = deque(items)

    def _tokens(self, n: int) -> list[int]:
        if self._at + n > len(self._pool):
            self._at = 0
        self._at += n
        return self._pool[self._at - n: self._at]

    def propose(self, states):
        trees = []
        for s in states:
            queue = self.queues.get(s.request_id)
            item = queue.popleft() if queue else None
            if item is None or item[0] == "plain":
                if item is not None and item[1] > 1:   # several plain tokens: one at a time
                    queue.appendleft(("plain", item[1] - 1))
                trees.append(None)
                continue
            parents, accepted = item
            trees.append(DraftTree(self._tokens(len(parents)), list(parents),
                                   replay_accept=list(accepted)) if parents else None)
        return trees

    def observe(self, state, verdict):
        pass


def _closed_loop(engine, requests: list[tuple[str, list[int], object]], concurrency: int):
    """Keep at most `concurrency` requests in flight (added as others finish) -> outputs."""
    pending, inflight, outs = deque(requests), 0, {}
    while pending or engine.has_unfinished_requests():
        while pending and inflight < concurrency:
            rid, prompt, params = pending.popleft()
            engine.add_request(rid, prompt, params)
            inflight += 1
        for out in engine.step():
            if out.finished:
                inflight -= 1
                outs[out.request_id] = out
    return outs


def _workload(recorded: list[dict], concurrency: int, args, repeat: int) -> list[dict]:
    """N(c) = max(c x waves, min_requests) recorded requests, spread over the whole set (text
    and arithmetic alike), a different spread each repeat."""
    n = max(concurrency * args.waves, args.min_requests)
    stride = len(recorded) / n
    offset = (repeat * 0.618034 * stride) % max(stride, 1)
    return [recorded[int(offset + i * stride) % len(recorded)] for i in range(n)]


def _paired(base: list[float], spec: list[float]) -> dict:
    ratios = [b / s for b, s in zip(base, spec)]
    return {"median": statistics.median(ratios), "mean": statistics.mean(ratios),
            "se": statistics.stdev(ratios) / math.sqrt(len(ratios)) if len(ratios) > 1 else 0.0,
            "range": [min(ratios), max(ratios)], "ratios": ratios,
            "target_s": base, "spec_s": spec}


def replay(args, recording: dict, model) -> dict:
    from rltlab.engine import LLM, SamplingParams
    vocab = model.config.vocab_size
    reqs = recording["requests"]
    longest = max(len(r["prompt"]) + r["length"] for rs in reqs.values() for r in rs)
    # every sequence's reservation, and blocks for the forks of its widest recorded tree (two
    # per leaf but the first), so that no tree is pruned for want of blocks
    leaves = max((sum(1 for i in range(len(p)) if i not in set(p)) for rs in reqs.values()
                  for r in rs for p, _ in r["items"] if p != "plain"), default=1)
    per_seq = -(-(longest + 8) // 16) + 2 * max(leaves - 1, 0)
    size = ({"kv_cache_memory_gib": args.kv_gib} if args.kv_gib else
            {"num_blocks": max(args.concurrency) * per_seq + 16})
    llm = LLM(model, max_num_seqs=max(args.concurrency), block_size=16,
              max_model_len=longest + 8, spec_max_concurrency=UNLIMITED, **size)
    engine = llm.llm_engine
    proposer = Replay(vocab)
    counter = itertools.count()

    def run(temperature, concurrency, repeat, spec: bool):
        batch, proposer.queues = [], {}
        for r in _workload(reqs[temperature], concurrency, args, repeat):
            rid = f"r{next(counter)}"
            params = SamplingParams(temperature=float(temperature), max_tokens=r["length"],
                                    seed=len(batch), ignore_eos=True, exit_policy="fixed")
            prompt = [t % vocab for t in r["prompt"]]
            batch.append((rid, prompt, params))
            if spec:
                proposer.load(rid, r["items"])
        engine.set_proposer(proposer if spec else None)
        sync()
        started = time.perf_counter()
        outs = _closed_loop(engine, batch, concurrency)
        sync()
        elapsed = time.perf_counter() - started
        engine.set_proposer(None)
        stats = [o.outputs[0].spec_stats for o in outs.values()]
        tokens = sum(len(o.outputs[0].token_ids) for o in outs.values())
        return elapsed, tokens, stats

    cells = [(t, c) for t in reqs for c in args.concurrency]
    for t, c in cells:   # warm-up: captures, compiles, a grown static decoder
        for spec in (False, True):
            run(t, c, 0, spec)
    seconds = {cell: ([], []) for cell in cells}
    taus = {cell: [] for cell in cells}
    expected = {cell: [] for cell in cells}
    for rep in range(args.repeats):
        for i, cell in enumerate(cells[rep % len(cells):] + cells[:rep % len(cells)]):
            order = (False, True) if (rep + i) % 2 == 0 else (True, False)
            for spec in order:
                elapsed, tokens, stats = run(*cell, rep + 1, spec)
                seconds[cell][spec].append(elapsed)
                if spec:
                    st = [s for s in stats if s]
                    taus[cell].append(sum(s["emitted"] for s in st) /
                                      max(sum(s["steps"] for s in st), 1))
                    expected[cell].append(_replay_tau(_workload(reqs[cell[0]], cell[1], args,
                                                                rep + 1)))
        print(f"repeat {rep + 1}/{args.repeats}: " + ", ".join(
            f"T={t} c={c} {seconds[(t, c)][0][-1] / seconds[(t, c)][1][-1]:.2f}x"
            for t, c in cells), flush=True)
    speedup = {}
    for (t, c), (base, spec) in seconds.items():
        speedup.setdefault(f"T={t}", {})[f"c={c}"] = {
            **_paired(base, spec), "replayed_tau": statistics.mean(taus[(t, c)]),
            "expected_tau": statistics.mean(expected[(t, c)]),
            "requests": max(c * args.waves, args.min_requests)}
    return speedup


def switch_off_point(speedup: dict) -> dict:
    """Per temperature, the smallest concurrency measured where the replayed speedup's median
    is below 1 (None: it paid at every c measured)."""
    out = {}
    for temp, by_c in speedup.items():
        losing = [int(c[2:]) for c, v in by_c.items() if v["median"] < 1.0]
        out[temp] = min(losing) if losing else None
    return out


# ---------------------------------------------------------------------------- program costs
def _cost_trees(depth: int, shipped: list) -> dict:
    """Row count -> (TreeProposer tree, lookup length): 5 = the heads' chain of 4, 16 = that
    chain beside a lookup chain of 10, 37 = the shipped 16-node tree."""
    chain = [(0,) * j for j in range(1, depth + 1)]
    return {5: (chain, 0), 16: (chain, 10), 37: (shipped, 0)}


def _tree_rows(tree, lookup) -> tuple[list[int], int]:
    """The generic verifier's tree for a TreeProposer shape: parents, and its row count."""
    from rltlab.engine.spec.tree_graph import TreeShape
    index = {p: i for i, p in enumerate(tree)}
    parents = [index[p[:-1]] if len(p) > 1 else -1 for p in tree]
    parents += [-1 if j == 0 else len(tree) + j - 1 for j in range(lookup)]
    paths = list(tree) + [(99,) * j for j in range(1, lookup + 1)]
    return parents, TreeShape(paths, "cpu").num_rows


class _Fixed:
    """Proposes one fixed tree shape (random tokens), accepting nothing (forced)."""

    def __init__(self, parents, vocab):
        self.parents, self.vocab = parents, vocab

    def propose(self, states):
        return [DraftTree([(7 * i + 3) % self.vocab for i in range(len(self.parents))],
                          list(self.parents), replay_accept=[]) for _ in states]

    def observe(self, state, verdict):
        pass


def _device_ms(fn, device, repeats: int) -> float:
    """Milliseconds per fn() on the device: CUDA events around `repeats` calls (after one
    warm-up), the host clock elsewhere."""
    fn()
    sync()
    if torch.device(device).type != "cuda":
        started = time.perf_counter()
        for _ in range(repeats):
            fn()
        return 1e3 * (time.perf_counter() - started) / repeats
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def _wall_ms(fn, device, repeats: int) -> float:
    fn()
    sync()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return 1e3 * (time.perf_counter() - started) / repeats


def program_costs(args, model) -> dict:
    """(module docstring, 3.) -> {rows: {...}} and the target token's cost."""
    from rltlab.draft_heads.lookahead import LookaheadHeads, read_metadata
    from rltlab.engine import LLM, SamplingParams, TreeProposer
    from rltlab.engine.spec.tree_graph import TreeShape, private_blocks
    from rltlab.model.presets import random_prompts
    device, cfg = args.device, model.config
    dtype = next(model.parameters()).dtype
    R, bs, context = cfg.num_rounds, 16, args.cost_context
    shipped = [tuple(p) for p in read_metadata(args.heads)["tree"]]
    heads = LookaheadHeads(model, depth=4, inner=1024).to(device=device, dtype=dtype).eval()
    trees = {rows: shape for rows, shape in _cost_trees(heads.depth, shipped).items()
             if rows in args.rows}
    proposers = {rows: TreeProposer(heads, tree, lookup=lookup)
                 for rows, (tree, lookup) in trees.items()}
    new = args.cost_tokens
    max_len = context + new + 128
    prompt = random_prompts(1, context, cfg.vocab_size, 0)
    # the static path everywhere (a TreeProposer's program needs it; the CPU runs its torch code)
    llm = LLM(model, max_num_seqs=1, block_size=bs, max_model_len=max_len,
              num_blocks=4 * -(-max_len // bs) + sum(map(private_blocks, proposers.values())),
              decode_path="static", spec_max_concurrency=UNLIMITED)
    engine = llm.llm_engine

    # a target token: target-only decoding's per-token wall time (token windows and all)
    def target(tokens):
        return lambda: llm.generate(prompt, SamplingParams(
            temperature=0.0, max_tokens=tokens, ignore_eos=True, exit_policy="fixed"))
    one, many = target(1), target(1 + new)
    one(), many()
    t_one = statistics.median(_wall_ms(one, device, 1) for _ in range(3))
    t_many = statistics.median(_wall_ms(many, device, 1) for _ in range(3))
    token_ms = (t_many - t_one) / new
    costs, bw, tflops = ModelCosts.of(model), copy_bandwidth(device), matmul_tflop_s(device,
                                                                                     dtype)

    def floor_ms(rows: int, depth_sum: int) -> dict:
        """Bytes: the shared weights once per round, the LM head once, each row's K/V reads
        (its context in every round's plane) and writes; FLOPs: every row's matmuls in R
        rounds, its attention pairs, the LM head."""
        kv = costs.kv_bytes_per_position * R * (rows * context + depth_sum + rows)
        bytes_ = R * costs.layer_bytes + costs.head_bytes + kv
        flops = R * (2 * costs.linear_params * rows + costs.attn_flops_per_pair
                     * (rows * context + depth_sum)) + 2 * costs.head_params * rows
        return {"bytes_ms": 1e3 * bytes_ / (bw * 1e9), "flops_ms": 1e3 * flops / (tflops * 1e12)}

    target_floor = floor_ms(1, 0)
    out = {}
    for rows, proposer in proposers.items():
        tree, lookup = trees[rows]
        parents, n_rows = _tree_rows(tree, lookup)
        shape = TreeShape(proposer.paths, "cpu")
        assert n_rows == shape.num_rows == rows, (rows, n_rows, shape.num_rows)
        depth_sum = sum(len(p) for p in proposer.paths)
        # the request at a token boundary, then timed steps of the generic verifier
        engine.set_proposer(_Fixed(parents, cfg.vocab_size))
        engine.add_request("cost", prompt[0], SamplingParams(
            temperature=0.0, max_tokens=new + 64, ignore_eos=True, exit_policy="fixed"))
        while not engine.scheduler.running or not engine.scheduler.running[0].output_token_ids:
            engine.step()
        seq = engine.scheduler.running[0]
        generic = engine._spec._generic
        steps = min(new, 16)
        step_ms = _wall_ms(lambda: generic.step([seq]), device, steps)
        # its device launch alone: the last step's rows staged again, R rounds
        views = [(seq, seq.num_tokens - 1 + i, 0) for i in range(rows)]
        runner = engine.runner
        runner._stage(views)
        emb = model.model.embed_tokens(torch.full((rows,), 5, device=device))
        launch_ms = _device_ms(lambda: runner.static.run_token(emb, R), device, args.replays) \
            if runner.static is not None else None
        engine.abort_request("cost")
        engine._drain_outputs()
        # the TreeProposer's own device program (greedy, c = 1), replays timed on the device
        engine.set_proposer(proposer)
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                            exit_policy="fixed"))
        graph = engine._spec._tree
        program = next(iter(graph._programs.values()), None)
        program_ms, program_kernels = None, None
        if program is not None:
            if program._graph is not None:
                program_ms = _device_ms(program._graph.replay, device, args.replays)
            else:
                program_ms = _device_ms(program._program, device, args.replays)
            if torch.device(device).type == "cuda":   # where its time goes, kernel by kernel
                program_kernels = kernel_profile(program._program, top=10)
        engine.set_proposer(None)
        floor = floor_ms(rows, depth_sum)
        bound = max(floor.values())
        out[str(rows)] = {
            "tree": [list(p) for p in tree], "lookup": lookup,
            "tree_program": _tokens(program_ms, token_ms),
            "generic_step": _tokens(step_ms, token_ms),
            "generic_launch": _tokens(launch_ms, token_ms),
            "roofline": round(bound / token_ms, 4),
            "roofline_vs_one_row": round(bound / max(target_floor.values()), 4),
            "tree_program_eager_kernels": program_kernels,
            "ms": {"tree_program": program_ms, "generic_step": step_ms,
                   "generic_launch": launch_ms, **floor}}
        shown = {k: v for k, v in out[str(rows)].items()
                 if k not in ("tree", "ms", "tree_program_eager_kernels")}
        print(f"{rows} rows: " + ", ".join(f"{k} {v}" for k, v in shown.items()), flush=True)
        if program_kernels:
            print(f"  {rows}-row tree program, eager kernels: {json.dumps(program_kernels)}",
                  flush=True)
    return {"target_token_ms": token_ms, "context": context, "copy_bandwidth_gb_s": bw,
            "matmul_tflop_s": tflops, "target_token_roofline_ms": max(target_floor.values()),
            "rows": out}


def _tokens(ms, token_ms):
    return None if ms is None else round(ms / token_ms, 4)


# ------------------------------------------------------------------------------------ main
def main(argv=None) -> dict:
    from rltlab.model.presets import PRESETS, preset_config, random_model
    ap = argparse.ArgumentParser(
        prog="python -m rltlab.bench.spec_replay",
        description="Replayed acceptance: drafts and acceptance recorded on the embedded model, "
                    "forced through the engine at a bigger shape against target-only decoding "
                    "(paired); optionally each verification program's cost in target tokens "
                    "beside its roofline. Last line: JSON.")
    add_device_argument(ap)
    add_proposer_arguments(ap, max_tokens=128)
    ap.add_argument("--ignore-eos", action="store_true",
                    help="record to max_tokens (default: stop at EOS, as the other benches)")
    ap.add_argument("--record-concurrency", type=int, default=16)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--preset", default="ouro-1.4b", choices=sorted(PRESETS),
                    help="the replay shape (random weights)")
    ap.add_argument("--dtype", default=None, help="replay dtype (default: bfloat16 on CUDA, "
                    "float32 elsewhere)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--waves", type=int, default=2,
                    help="requests per concurrency c: max(c x waves, --min-requests)")
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5, help="paired repeats per (c, T)")
    ap.add_argument("--kv-gib", type=float, default=None,
                    help="the replay engine's KV pool (default: from free GPU memory)")
    ap.add_argument("--program-costs", action="store_true",
                    help="also profile 5/16/37-row verification programs at c = 1")
    ap.add_argument("--rows", type=int, nargs="+", default=[5, 16, 37], choices=(5, 16, 37))
    ap.add_argument("--cost-context", type=int, default=128, help="prompt length for them")
    ap.add_argument("--cost-tokens", type=int, default=128,
                    help="target-only tokens timed for the target token's cost")
    ap.add_argument("--replays", type=int, default=50, help="device replays timed per program")
    ap.add_argument("--skip-replay", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    for name in ("prompts", "max_tokens", "record_concurrency", "waves", "min_requests",
                 "repeats", "cost_tokens", "replays", "cost_context"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if any(c < 1 for c in args.concurrency) or args.lookup < 0:
        ap.error("--concurrency values must be >= 1 and --lookup >= 0")
    cuda = torch.device(args.device).type == "cuda"
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda
                                                           else torch.float32)
    started = time.perf_counter()
    result = {"label": LABEL, "commit": git_commit(), "hardware": environment(),
              "device": str(args.device), "dtype": str(dtype).removeprefix("torch."),
              "preset": args.preset,
              "args": {k: v if isinstance(v, (int, float, str, list, bool, type(None))) else str(v)
                       for k, v in vars(args).items()}}
    model = None

    def save(done: bool) -> None:   # after each phase: a run stopped later keeps the rest
        result["finished"] = done
        if args.out:
            write_json_atomic(args.out, result)

    if not args.skip_replay:
        recording = record(args)
        result["recorded_tau"] = recording["tau"]
        print(f"recorded tau: {json.dumps(recording['tau'])}", flush=True)
        model = random_model(preset_config(args.preset), args.device, dtype)
        speedup = replay(args, recording, model)
        result["replayed_speedup"] = {t: {c: {k: (round(v, 4) if isinstance(v, float) else v)
                                               for k, v in cell.items()}
                                           for c, cell in by_c.items()}
                                      for t, by_c in speedup.items()}
        result["switch_off_point"] = switch_off_point(speedup)
        from rltlab.engine.spec.decoder import SPEC_MAX_CONCURRENCY_CUDA
        result["spec_max_concurrency_cuda_default"] = SPEC_MAX_CONCURRENCY_CUDA
        save(False)
    if args.program_costs:
        model = model or random_model(preset_config(args.preset), args.device, dtype)
        costs = program_costs(args, model)
        result["program_costs"] = costs
        result["program_cost_target_tokens"] = {
            rows: {k: v for k, v in cell.items() if k not in ("tree", "lookup", "ms")}
            for rows, cell in costs["rows"].items()}
    result["wall_s"] = round(time.perf_counter() - started, 1)
    save(True)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
