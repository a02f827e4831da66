"""Trace collection during real generations: the engine's per-round observer, or in teacher mode
its decode capture.

    collector = TraceCollector(llm, out_dir, teacher=True, hidden_dtype="bfloat16")
    outputs = collector.generate(prompts, SamplingParams(temperature=0, max_tokens=64,
                                                         exit_threshold=0.5))
    collector.close()            # flushes the last shard; the manifest lists every shard

For every DECODE token (the input at position P + i - 1 whose rounds produce output token
i >= 1; the first output token comes from the full-depth prefill and is not traced) and every
round it executes, the collector stores h_r (optionally through a fixed random projection),
the gate logit, hazard, CDF and the prediction statistics of rltlab.traces.stats, plus the
request metadata (prompt id, position, weight version, model hash per version, seed).

Teacher mode runs all R rounds for every token, so every round has labels, while recording the
round the request's exit policy WOULD have selected (field `selected`): the request's policy is
wrapped by a policy that asks it after each round and always answers "continue". The generated
text is then the full-depth rollout (its tokens come from round R). Without teacher mode the
policy acts for real (LAST_EXITED); tokens have `executed` = selected rounds and the reference
statistics refer to the exit round.

Fast path (capture.py): in teacher mode, when the engine runs whole-token steps (the static
decode path), has no other observer and no proposer, and every request's policy is one whose
choice follows from the gate logits (capture.REPLAYABLE_POLICIES: q_exit, q_exit_delayed, fixed,
with max_loops = R), no observer is attached. The requests run at fixed depth R, which generates
the same text, on the engine's whole-token steps and token windows, whose launches capture each
round's h_r and gate logit on the device (LLMEngine.set_decode_capture); the statistics are
computed afterwards in batches on the device and `selected` by replaying the policy on the gate
logits. The records are the observer path's (same fields, tokens and selected rounds; floats
up to the batching of the arithmetic); only the order of requests inside the running shards
may differ, as requests finish in another order. TraceCollector.fast_path_applies says which
path a call takes; everything else takes the observer path.

A directory's manifest maps each weight version to one model hash (info.model_hashes): a
collector refuses to add traces of weights whose hash differs from the one recorded for the
engine's weight version (another model appended "at version 0" would otherwise be recorded
under the first model's hash). Two collectors cannot write one manifest at once
(storage.TraceDirectoryLocked).
"""
from __future__ import annotations

import dataclasses
import itertools
import time
import uuid
from pathlib import Path
from typing import Any, Sequence

import torch

from rltlab.engine.exit_policies import ExitPolicy, create_exit_policy, register_exit_policy
from rltlab.traces.capture import FLUSH_TOKENS, REPLAYABLE_POLICIES, TeacherCapture
from rltlab.traces.stats import stats_from_logprobs_batch
from rltlab.traces.storage import MANIFEST, TraceWriter, concat_columns, dtype_name

_COLLECTOR_IDS = itertools.count()


def random_projection(in_dim: int, out_dim: int, seed: int = 0) -> torch.Tensor:
    """A fixed Gaussian projection [in_dim, out_dim] / sqrt(out_dim) from a seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(in_dim, out_dim, generator=gen) / out_dim ** 0.5


class _TeacherPolicy(ExitPolicy):
    """Wraps the requests' exit policies: records what they select, always continues.

    The wrapped policy is named per request in exit_policy_args["teacher_of"]; it is created
    like the engine creates policies (the engine's default policy with EngineConfig's
    exit_policy_args). Registered under a unique name through register_exit_policy; it holds
    no reference to the engine.
    """

    def __init__(self, model_config, default_policy: str, default_args: dict, selected: dict):
        self.name = f"teacher-{uuid.uuid4().hex[:8]}"
        self.model_config, self.selected = model_config, selected
        self.default_policy, self.default_args = default_policy, dict(default_args)
        self.inner: dict[str, ExitPolicy] = {}

    def _inner(self, name: str) -> ExitPolicy:
        if name not in self.inner:
            kwargs = self.default_args if name == self.default_policy else {}
            self.inner[name] = create_exit_policy(name, self.model_config, **kwargs)
        return self.inner[name]

    def validate(self, params, num_rounds):
        if "teacher_of" not in params.exit_policy_args:
            raise ValueError("teacher policy needs exit_policy_args['teacher_of']")
        self._inner(params.exit_policy_args["teacher_of"]).validate(params, num_rounds)

    def decide(self, info):
        rounds = info.rounds.cpu()
        groups: dict[str, list[int]] = {}
        for row, seq in enumerate(info.seqs):
            key = (seq.request_id, seq.index, seq.num_tokens - 1)
            if key not in self.selected:
                groups.setdefault(seq.params.exit_policy_args["teacher_of"], []).append(row)
        for name, rows in groups.items():
            targets = self._inner(name).decide(info.select(rows)).tolist()
            for row, target in zip(rows, targets):
                seq, rnd = info.seqs[row], int(rounds[row])
                if target >= rnd:  # exit now (== r) or a committed later round (> r)
                    self.selected[(seq.request_id, seq.index, seq.num_tokens - 1)] = int(target)
        return torch.zeros_like(rounds)   # always continue; round R exits by itself


@dataclasses.dataclass
class _Pending:
    hidden: list = dataclasses.field(default_factory=list)
    logp: list = dataclasses.field(default_factory=list)
    gates: list = dataclasses.field(default_factory=list)
    version: int = 0


class TraceCollector:
    """Attach to an engine (rltlab.engine.LLM or LLMEngine), generate, write trace shards.

    hidden_dtype: storage dtype of h_r ("float32", "bfloat16", "float16").
    projection_dim: store h_r @ P (P fixed, Gaussian, from projection_seed) instead of h_r.
    store_hidden: False drops the hidden state (statistics only; hidden is [N, R, 0]).
    manifest_name: see TraceWriter (one manifest per data-parallel rank).
    """

    def __init__(self, llm, out_dir: str | Path, *, teacher: bool = False,
                 hidden_dtype: str = "float32", projection_dim: int | None = None,
                 projection_seed: int = 0, store_hidden: bool = True,
                 shard_tokens: int = 4096, info: dict[str, Any] | None = None,
                 manifest_name: str = MANIFEST):
        self.engine = getattr(llm, "llm_engine", llm)
        self.num_rounds = self.engine.num_rounds
        hidden_size = self.engine.model_config.hidden_size
        self.projection = None
        dim = hidden_size
        if projection_dim is not None:
            self.projection = random_projection(hidden_size, projection_dim, projection_seed)
            dim = projection_dim
        if not store_hidden:
            dim, self.projection = 0, None
        self.store_hidden, self.dim = store_hidden, dim
        self._projection_on = None   # the projection on the engine's device
        self.teacher = teacher
        self.writer = TraceWriter(
            out_dir, num_rounds=self.num_rounds, hidden_dim=dim, dtype=hidden_dtype,
            shard_tokens=shard_tokens, projection=self.projection,
            projection_seed=projection_seed if self.projection is not None else None,
            info={"teacher": teacher, **(info or {})}, manifest_name=manifest_name)
        self.out_dir = self.writer.dir
        self.model_hashes: dict[str, str] = dict(self.writer.manifest["info"].get(
            "model_hashes", {}))
        self._checked_versions: set[str] = set()
        try:    # before anything is traced: the directory may hold another model's version
            self._check_hash(self.engine.get_weight_version())
        except BaseException:
            self.writer.close()
            raise
        self._pending: dict[tuple, _Pending] = {}
        self._done: dict[str, list[dict[str, Any]]] = {}
        self._requests: dict[str, dict[str, Any]] = {}
        self._selected: dict[tuple, int] = {}
        self._group: list[dict[str, Any]] | None = None   # records of a shard_group call
        self._teacher_policy = None
        if teacher:
            cfg = self.engine.config
            self._teacher_policy = _TeacherPolicy(self.engine.model_config, cfg.exit_policy,
                                                  cfg.exit_policy_args, self._selected)
            policy = self._teacher_policy
            register_exit_policy(policy.name, lambda _cfg, **_kw: policy)
        self._tag = f"t{next(_COLLECTOR_IDS)}-{uuid.uuid4().hex[:6]}"
        # host seconds: generate() in all, of it the observer / capture and the shard writes
        self.stats = {"tokens": 0, "requests": 0, "observe_s": 0.0, "generate_s": 0.0,
                      "write_s": 0.0}

    # --------------------------------------------------------------------------- generation
    def generate(self, prompts: Sequence[Sequence[int]], params, prompt_ids: Sequence[int]
                 | None = None, shard_group: str | None = None) -> list:
        """Generate for every prompt (token ids) and trace it; returns the RequestOutputs in
        input order. params: one SamplingParams or one per prompt. prompt_ids default to
        0..N-1 (give stable ids to join traces with tasks). shard_group: write this call's
        records, sorted by (prompt id, sample, position), as their own shards named after the
        group (TraceWriter.write_group) instead of streaming them into the running shards."""
        from rltlab.engine import SamplingParams

        engine = self.engine
        if engine.has_unfinished_requests():
            raise RuntimeError("TraceCollector.generate needs an idle engine")
        self._check_hash(engine.get_weight_version())
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) \
            else list(params)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        prompt_ids = list(range(len(prompts))) if prompt_ids is None else list(prompt_ids)
        start = time.perf_counter()
        capture = None
        if self.fast_path_applies(params_list):
            capture = TeacherCapture(engine, self._stored_hidden, self._teacher_policy._inner)
        self._group = [] if shard_group is not None else None
        ids = []
        for prompt, param, pid in zip(prompts, params_list, prompt_ids):
            if self.teacher:
                inner = param.exit_policy or engine.config.exit_policy
                param = dataclasses.replace(
                    param, exit_policy=self._teacher_policy.name,
                    exit_policy_args={**param.exit_policy_args, "teacher_of": inner})
            rid = f"{self._tag}-{pid}-{len(self._requests)}"
            self._requests[rid] = {"prompt_id": int(pid), "prompt_len": len(prompt)}
            if capture is not None:
                # what the observer path's request runs under (seed drawn, defaults filled
                # in), checked as add_request checks it; the engine runs it at fixed depth R
                param = engine.resolve_params(param)
                self._teacher_policy.validate(param, self.num_rounds)
                capture.track(rid, int(pid), len(prompt), param, inner)
                param = dataclasses.replace(param, exit_policy="fixed",
                                            exit_policy_args={"depth": self.num_rounds})
            ids.append(engine.add_request(rid, list(prompt), param))
        if capture is not None:
            engine.set_decode_capture(capture)
        else:
            handle = engine.add_round_observer(self._observe, with_logits=True)
        try:
            results = self._run(ids, capture)
        finally:
            if capture is not None:
                engine.set_decode_capture(None)
                self.stats["observe_s"] += capture.seconds
            else:
                engine.remove_round_observer(handle)
        if shard_group is not None:
            if capture is not None:
                self._write(self.writer.write_group, _sorted_columns(self._group), shard_group)
            else:
                self._group.sort(key=lambda r: (r["prompt_id"], r["sample_index"],
                                                r["position"]))
                self._write(self.writer.write_group, self._group, shard_group)
            self._group = None
        self.stats["generate_s"] += time.perf_counter() - start
        return [results[rid] for rid in ids]

    def fast_path_applies(self, params: Sequence) -> bool:
        """Whether generate() with these SamplingParams takes the fast path (module docstring):
        teacher mode, an engine with whole-token steps and neither a round observer nor a
        proposer, and every request's policy replayable with max_loops = R."""
        engine = self.engine
        if not (self.teacher and engine.decode_capture_available and not engine.observers
                and engine.proposer is None):
            return False
        return all(type(self._teacher_policy._inner(p.exit_policy or engine.config.exit_policy))
                   in REPLAYABLE_POLICIES and p.max_loops in (None, self.num_rounds)
                   for p in params)

    def _run(self, ids: list[str], capture: TeacherCapture | None) -> dict[str, Any]:
        """Step the engine until the requests `ids` finish; their records go to the writer
        (the fast path's at each flush, in the order the requests finished)."""
        engine, results = self.engine, {}
        while len(results) < len(ids):
            for out in engine.step():
                if not out.finished:
                    continue
                results[out.request_id] = out
                if capture is None:
                    self._finish_request(out)
                    continue
                # the output names the params the observer path's request runs under
                out.sampling_params = capture.requests[out.request_id].params
                capture.finish(out)
                self.stats["requests"] += 1
            if capture is not None and capture.captured_tokens >= FLUSH_TOKENS:
                self._add_columns(capture.flush())
        if capture is not None:
            self._add_columns(capture.flush())
        return results

    def close(self) -> dict[str, Any]:
        """Flush the last shard, release the directory; returns the manifest (again, without
        writing, on a second call)."""
        if self.writer.closed:
            return self.writer.manifest
        self.writer.update_info(model_hashes=self.model_hashes,
                                collection_stats={k: round(v, 4) if isinstance(v, float) else v
                                                  for k, v in self.stats.items()})
        return self.writer.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ----------------------------------------------------------------------------- internals
    def _check_hash(self, version: int) -> None:
        """Record the engine's model hash for `version`, or refuse if the directory recorded
        another one for it (checked once per version and collector)."""
        key = str(version)
        if key in self._checked_versions:
            return
        from rltlab.model.checkpoint import model_hash
        digest = model_hash(self.engine.model)
        recorded = self.model_hashes.get(key)
        if recorded is not None and recorded != digest:
            raise ValueError(
                f"{self.out_dir} holds traces of weight version {version} from model {recorded}, "
                f"but this engine's weights at version {version} hash to {digest}: traces of "
                "other weights cannot share the version; use a new directory (or an engine "
                "weight_version that the directory does not hold)")
        self._checked_versions.add(key)
        if recorded is None:
            self.model_hashes[key] = digest
            self.writer.update_info(model_hashes=self.model_hashes)

    def _ensure_hash(self, version: int) -> None:
        if str(version) not in self.model_hashes:
            from rltlab.model.checkpoint import model_hash
            self.model_hashes[str(version)] = model_hash(self.engine.model)
            self.writer.update_info(model_hashes=self.model_hashes)

    def _stored_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """h_r [..., H] as stored: through the projection (in fp32) if any, in the storage
        dtype; [..., 0] without hidden states."""
        if self.projection is not None:
            if self._projection_on is None or self._projection_on.device != hidden.device:
                self._projection_on = self.projection.to(hidden.device)
            hidden = hidden.float() @ self._projection_on
        return hidden.to(self.writer.dtype) if self.store_hidden else hidden[..., :0]

    def _write(self, write, *args) -> None:
        """write(*args), one of the writer's, its host time counted in stats["write_s"]."""
        started = time.perf_counter()
        write(*args)
        self.stats["write_s"] += time.perf_counter() - started

    def _add_columns(self, columns: dict[str, torch.Tensor] | None) -> None:
        """Fast-path records (capture.py) to the running shards, or to this call's group."""
        if columns is None:
            return
        if self._group is not None:
            self._group.append(columns)
        else:
            self._write(self.writer.add_columns, columns)
        self.stats["tokens"] += len(columns["token"])
        for version in set(columns["weight_version"].tolist()):
            self._ensure_hash(version)

    def _observe(self, event) -> None:
        """Per round: this collector's decode rows, their log-softmax, hidden state (projected,
        in the storage dtype) and gate logit, kept on the engine's device until the token's
        last round; the tokens that end now get their statistics in one batch there
        (_finish_tokens). Host copies: the rows' round and position, and the finished tokens'
        small statistics and hidden states (never a [V] row per round)."""
        start = time.perf_counter()
        rows = [i for i, (d, rid) in enumerate(zip(event.is_decode.tolist(), event.request_ids))
                if d and rid in self._requests]
        if not rows:
            self.stats["observe_s"] += time.perf_counter() - start
            return
        device = event.hidden.device
        host_idx = torch.tensor(rows)
        idx = host_idx.to(device, non_blocking=True)
        logp = torch.log_softmax(event.logits[idx].float(), dim=-1)
        hidden = self._stored_hidden(event.hidden[idx])
        gate = event.gate_logits[idx].float()
        rounds, positions = torch.stack([event.rounds[idx], event.positions[idx]]).tolist()
        exits = event.exits[host_idx.to(event.exits.device)].tolist()
        finished = []
        for j, row in enumerate(rows):
            key = (event.request_ids[row], event.sample_indices[row], positions[j])
            if rounds[j] == 1 or key not in self._pending:
                self._pending[key] = _Pending()   # (a restart after a weight update resets it)
            entry = self._pending[key]
            entry.hidden.append(hidden[j])
            entry.logp.append(logp[j])
            entry.gates.append(gate[j])
            entry.version = event.weight_version
            if exits[j] or rounds[j] >= self.num_rounds:
                finished.append((key, self._pending.pop(key)))
        if finished:
            self._finish_tokens(finished)
        self.stats["observe_s"] += time.perf_counter() - start

    def _finish_tokens(self, finished: list) -> None:
        """Records of tokens whose rounds are all observed: their statistics computed in one
        batch per executed-round count, on the device, then copied to the host together."""
        by_rounds: dict[int, list] = {}
        for key, entry in finished:
            by_rounds.setdefault(len(entry.logp), []).append((key, entry))
        for executed, group in by_rounds.items():
            logp = torch.stack([torch.stack(e.logp) for _, e in group])        # [m, E, V]
            gates = torch.stack([torch.stack(e.gates) for _, e in group])      # [m, E]
            hidden = torch.stack([torch.stack(e.hidden) for _, e in group])    # [m, E, D]
            stats = stats_from_logprobs_batch(logp, gates)
            stats["hidden"] = hidden
            stats = {k: v.cpu() for k, v in stats.items()}
            for i, (key, entry) in enumerate(group):
                self._finish_token(key, entry.version, executed,
                                   {k: v[i] for k, v in stats.items()})

    def _finish_token(self, key, version: int, executed: int, stats: dict) -> None:
        request_id, sample_index, position = key
        req = self._requests[request_id]
        selected = self._selected.pop(key, self.num_rounds) if self.teacher else executed
        R, pad = self.num_rounds, self.num_rounds - executed

        def padded(x, fill=0.0):
            return torch.cat([x, torch.full((pad,), fill, dtype=x.dtype)]) if pad else x
        hidden = stats["hidden"]
        if pad:
            hidden = torch.cat([hidden, hidden.new_zeros(pad, hidden.shape[1])])
        record = {
            "hidden": hidden, "round_mask": torch.arange(R) < executed,
            "top1_id": padded(stats["top1_id"], 0).int(),
            **{k: padded(stats[k]) for k in ("gate_logit", "hazard", "cdf", "top1_prob",
                                              "margin", "entropy", "logprob_ref", "kl_ref")},
            "executed": executed, "selected": selected, "ref_round": executed,
            "ref_token": int(stats["ref_token"]), "token": -1, "position": position,
            "output_index": position - req["prompt_len"] + 1, "prompt_id": req["prompt_id"],
            "sample_index": sample_index, "weight_version": version, "seed": 0}
        self._done.setdefault(request_id, []).append(record)

    def _finish_request(self, out) -> None:
        records = self._done.pop(out.request_id, [])
        params = out.sampling_params
        for rec in records:
            comp = out.outputs[rec["sample_index"]]
            i = rec["output_index"]
            rec["token"] = comp.token_ids[i] if i < len(comp.token_ids) else -1
            rec["seed"] = params.sample_seed(rec["sample_index"]) if params.seed is not None \
                else -1
        records.sort(key=lambda r: (r["sample_index"], r["position"]))
        if self._group is not None:
            self._group.extend(records)
        else:
            self._write(self.writer.add, records)
        self.stats["tokens"] += len(records)
        self.stats["requests"] += 1
        for version in {r["weight_version"] for r in records}:
            self._ensure_hash(version)


def _sorted_columns(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor] | list:
    """Fast-path columns of one shard group, by (prompt id, sample, position); [] if none."""
    if not parts:
        return []
    columns = concat_columns(parts)
    keys = list(zip(*(columns[k].tolist() for k in ("prompt_id", "sample_index", "position"))))
    order = torch.tensor(sorted(range(len(keys)), key=keys.__getitem__), dtype=torch.int64)
    return {k: v.index_select(0, order) for k, v in columns.items()}


def collect_traces(llm, prompts: Sequence[Sequence[int]], params, out_dir: str | Path, *,
                   prompt_ids: Sequence[int] | None = None, batch_size: int | None = None,
                   **collector_kwargs) -> tuple[list, dict[str, Any]]:
    """One-shot: trace generations of `prompts` into out_dir; returns (outputs, manifest)."""
    collector = TraceCollector(llm, out_dir, **collector_kwargs)
    outputs = []
    try:
        from rltlab.engine import SamplingParams
        ids = list(range(len(prompts))) if prompt_ids is None else list(prompt_ids)
        step = batch_size or len(prompts) or 1
        for start in range(0, len(prompts), step):
            part = params if isinstance(params, SamplingParams) else params[start:start + step]
            outputs += collector.generate(prompts[start:start + step], part,
                                          ids[start:start + step])
    finally:
        manifest = collector.close()
    return outputs, manifest


def collection_overhead(llm, prompts: Sequence[Sequence[int]], params, out_dir: str | Path,
                        repeats: int = 1, profile: bool = False, **collector_kwargs
                        ) -> dict[str, Any]:
    """Throughput of the same rollouts with and without trace collection, in this run, on the
    engine's device: `prompts` are generated without an observer (the engine's fastest path
    for them) and with a TraceCollector(**collector_kwargs) into a temporary directory under
    out_dir (removed after), alternately, after one untimed run of each (CUDA graphs are
    captured on first use). "The same rollouts": in teacher mode every token runs all R
    rounds and the text is the full-depth rollout, so the plain run is `params` at fixed depth
    R (the same tokens; same_tokens says whether they were); otherwise `params` as given.

    Returns plain_s / traced_s (median of repeats), tokens/s of each, throughput_ratio =
    traced / plain tokens per second (1.0: collection is free; the acceptance bar at the 1.4B
    shape is >= 0.8), overhead_x = traced_s / plain_s, fast_path (whether the collector took
    the decode capture, see the module docstring), observer_s (host time in the observer, or
    in the decode capture and its statistics), traced_split_s (where a traced run's host time
    went: open = the collector's construction, its model hash included; generate = generate()
    in all, of it observe = observer_s and write = records into shards; close = the last
    shard and the manifest), host_pauses (plain / traced, medians over the timed runs: the
    garbage collector's collections and seconds, on CUDA the allocator's cudaMalloc calls and
    retries, rltlab.common.profiling.host_pauses, and the CUDA graphs captured and their
    seconds, which the warm-up runs should leave at 0), output tokens, the device and dtypes. The
    temporary traces are checked against the free disk space first (rltlab.traces.size).
    profile: after the timed runs, one more of each under torch.profiler (`profile`: plain and
    traced, rltlab.common.profiling.phase_profile): on a GPU, the device kernel time by class
    names what a traced run adds that no host timer sees; and one more of each under cProfile
    (plain_host, traced_host: host_profile), the host functions that take its time."""
    import shutil
    import statistics

    from rltlab.common.profiling import host_pauses
    from rltlab.engine.llm import LLM
    from rltlab.engine.static_decode import graphs_captured
    from rltlab.traces.size import check_disk, trace_bytes

    if not isinstance(llm, LLM):
        raise TypeError("collection_overhead needs an rltlab.engine.LLM")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    engine = llm.llm_engine
    prompts = [list(p) for p in prompts]
    teacher = bool(collector_kwargs.get("teacher", False))
    R = engine.num_rounds
    plain_params = dataclasses.replace(params, exit_policy="fixed",
                                       exit_policy_args={"depth": R}, min_loops=1) \
        if teacher else params
    out_dir = Path(out_dir)
    projection = collector_kwargs.get("projection_dim")
    dim = projection or engine.model_config.hidden_size
    check_disk(out_dir, trace_bytes(
        len(prompts) * max(1, params.max_tokens - 1) * params.n, num_rounds=R, hidden_dim=dim,
        hidden_dtype=collector_kwargs.get("hidden_dtype", "float32"),
        shard_tokens=collector_kwargs.get("shard_tokens", 4096),
        projection=(engine.model_config.hidden_size, projection) if projection else None))

    def plain():
        return llm.generate(prompts, plain_params)

    fast_path = []

    def traced(target: Path):
        shutil.rmtree(target, ignore_errors=True)
        opened = time.perf_counter()
        collector = TraceCollector(engine, target, **collector_kwargs)
        split = {"open": time.perf_counter() - opened}
        fast_path.append(collector.fast_path_applies([params]))
        try:
            outs = collector.generate(prompts, params)
        finally:
            closing = time.perf_counter()
            collector.close()
            split["close"] = time.perf_counter() - closing
            shutil.rmtree(target, ignore_errors=True)
        split.update(generate=collector.stats["generate_s"], observe=collector.stats["observe_s"],
                     write=collector.stats["write_s"])
        return outs, split

    pauses = {"plain": [], "traced": []}

    def timed(fn, *args):
        _sync(engine)
        with host_pauses() as counts, graphs_captured() as captured:
            t0 = time.perf_counter()
            result = fn(*args)
            _sync(engine)
            seconds = time.perf_counter() - t0
        # one-off work the warm-up runs should have done: CUDA graphs captured in a timed run
        counts.update(graphs_captured=captured["graphs"],
                      capture_s=round(captured["seconds"], 4))
        pauses["plain" if fn is plain else "traced"].append(counts)
        return result, seconds

    plain()                                   # warm-ups: graphs, kernels, allocator
    traced(out_dir / "overhead-warmup")
    plain_s, traced_s, splits = [], [], []
    plain_outs = traced_outs = None
    for k in range(repeats):
        plain_outs, secs = timed(plain)
        plain_s.append(secs)
        (traced_outs, split), secs = timed(traced, out_dir / f"overhead-{k}")
        traced_s.append(secs)
        splits.append(split)
    profiles = None
    if profile:
        from rltlab.common.profiling import host_profile, phase_profile
        profiles = {"plain": phase_profile(plain),
                    "traced": phase_profile(lambda: traced(out_dir / "overhead-profile")),
                    "plain_host": host_profile(plain),
                    "traced_host": host_profile(lambda: traced(out_dir / "overhead-profile"))}
    try:
        out_dir.rmdir()   # only if empty (it was created for the temporary traces)
    except OSError:
        pass
    p, t = statistics.median(plain_s), statistics.median(traced_s)
    tokens = sum(len(o.outputs[0].token_ids) for o in plain_outs)
    traced_tokens = sum(len(o.outputs[0].token_ids) for o in traced_outs)
    plain_tps = tokens / p if p > 0 else float("nan")
    traced_tps = traced_tokens / t if t > 0 else float("nan")
    return {"plain_s": p, "traced_s": t, "overhead_x": t / p if p > 0 else float("nan"),
            "plain_tokens_per_s": plain_tps, "traced_tokens_per_s": traced_tps,
            "throughput_ratio": traced_tps / plain_tps if plain_tps > 0 else float("nan"),
            "observer_s": statistics.median(s["observe"] for s in splits),
            "traced_split_s": {part: round(statistics.median(s[part] for s in splits), 4)
                               for part in splits[0]},
            "host_pauses": {run: {k: statistics.median(c[k] for c in counts) for k in counts[0]}
                            for run, counts in pauses.items()},
            "output_tokens": tokens,
            "traced_output_tokens": traced_tokens, "prompts": len(prompts),
            "repeats": repeats,
            "same_tokens": [o.outputs[0].token_ids for o in plain_outs]
            == [o.outputs[0].token_ids for o in traced_outs],
            "baseline": (f"the same prompts at fixed depth {R} (the teacher rollout's tokens), "
                         "no observer" if teacher else "the same prompts and params, no observer"),
            "teacher": teacher, "fast_path": all(fast_path),
            "hidden_dtype": collector_kwargs.get("hidden_dtype", "float32"),
            "engine_dtype": dtype_name(next(engine.model.parameters()).dtype),
            "device": str(engine.runner.device),
            **({"profile": profiles} if profiles else {})}


def _sync(engine) -> None:
    """Wait for the engine's device (timings end when its work has)."""
    device = torch.device(engine.runner.device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
