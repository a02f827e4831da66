"""Teacher-mode traces through the engine's decode capture: the fast collection path.

A round observer makes the engine step one round at a time and compute fp32 full-vocabulary
logits after every round. In teacher mode none of that is needed while generating: every token
runs all R rounds, the text is the full-depth rollout (the tokens of exit policy `fixed` at
depth R), and `selected` follows from the recorded gate logits alone when the request's policy
is one of REPLAYABLE_POLICIES. So TraceCollector (collect.py) then runs the requests at fixed
depth R on the engine's whole-token steps and token windows with the decode capture set
(rltlab.engine.hooks.DecodeCapture): each launch leaves h_r and the gate logit of every round of
its rows in a device buffer, and TeacherCapture keeps copies of the collector's rows on the
device. Every FLUSH_TOKENS captured tokens, and when the collector's generate call ends, flush()
computes their statistics on the device in batches (the LM head applied to the stored h_r,
rltlab.traces.stats.stats_of_hidden), replays the policy on the gate logits for
`selected`, moves the results to the host in one go and returns the columns of the requests
that finished meanwhile, in the order they finished, each by (sample, position): the records the
observer path writes, field for field.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch

from rltlab.common.device import to_device
from rltlab.engine.exit_policies import (DelayedQExit, ExitPolicy, FixedDepth, QExit,
                                         RoundInfo)
from rltlab.traces.stats import stats_of_hidden
from rltlab.traces.storage import concat_columns

# Policies whose decision after round r reads only the request's params and the gate logits
# g_1..g_r (and is the same whichever other rows are asked with it): replayed after the fact,
# they select what they would have selected asked round by round. Exact classes: a subclass
# may decide otherwise.
REPLAYABLE_POLICIES = (QExit, DelayedQExit, FixedDepth)
# Captured tokens kept on the device before their statistics are computed (~130 MB of bf16
# h_r at the Ouro-1.4B shape).
FLUSH_TOKENS = 8192

Key = tuple[str, int, int]   # (request id, sample index, input position)


@dataclasses.dataclass
class _Request:
    prompt_id: int
    prompt_len: int
    params: object        # the params the observer path's request runs under (resolved)
    policy: str           # the policy the teacher asks (the request's own)


@dataclasses.dataclass
class _Captured:
    """Whole tokens captured in one launch (or completed in one round step), on the device."""
    keys: list[Key]
    hidden: torch.Tensor   # [m, R, H] model dtype
    gates: torch.Tensor    # fp32 [m, R]
    version: int


class _ReplayRow:
    """What a replayed policy reads of a row's sequence (RoundInfo.seqs): its params."""
    __slots__ = ("params",)

    def __init__(self, params):
        self.params = params


class TeacherCapture:
    """The decode capture of one TraceCollector (hooks.DecodeCapture) and the records it makes.

    stored_hidden(h [m, R, H]) -> h as stored (projection, storage dtype); policy_of(name) ->
    the policy object the teacher path asks for requests naming `name`.
    """

    def __init__(self, engine, stored_hidden: Callable[[torch.Tensor], torch.Tensor],
                 policy_of: Callable[[str], ExitPolicy]):
        self.engine, self.num_rounds = engine, engine.num_rounds
        self.stored_hidden, self.policy_of = stored_hidden, policy_of
        self.requests: dict[str, _Request] = {}
        self._captured: list[_Captured] = []
        self.captured_tokens = 0   # on the device, statistics not computed yet
        self._partial: dict[Key, tuple[list, list]] = {}   # round-stepped tokens in progress
        self._host: dict[str, torch.Tensor] | None = None   # computed, not yet written
        self._host_keys: list[Key] = []
        self._finished: list = []    # RequestOutputs to write, in the order they finished
        self.seconds = 0.0           # host time in the capture calls and flushes

    def track(self, request_id: str, prompt_id: int, prompt_len: int, params, policy: str):
        self.requests[request_id] = _Request(prompt_id, prompt_len, params, policy)

    def finish(self, output) -> None:
        """A tracked request finished: its records go out with the next flush."""
        self._finished.append(output)

    # ------------------------------------------------------------------- hooks.DecodeCapture
    def tokens(self, seqs, positions, hidden, gate_logits, weight_version) -> None:
        start = time.perf_counter()
        keys = [(seq.request_id, seq.index, pos) for seq, pos in zip(seqs, positions)]
        mine = [i for i, key in enumerate(keys) if key[0] in self.requests]
        if len(mine) < len(keys):
            index = to_device(mine, torch.int64, hidden.device)
            keys, hidden, gate_logits = ([keys[i] for i in mine], hidden.index_select(0, index),
                                         gate_logits.index_select(0, index))
        if keys:
            if hidden.shape[1] != self.num_rounds:
                raise RuntimeError(f"teacher traces need all {self.num_rounds} rounds of a "
                                   f"token, the decode capture gave {hidden.shape[1]}")
            self._captured.append(_Captured(keys, hidden, gate_logits, weight_version))
            self.captured_tokens += len(keys)
        self.seconds += time.perf_counter() - start

    def round(self, seqs, positions, rounds, hidden, gate_logits, weight_version) -> None:
        start = time.perf_counter()
        done = []
        for j, (seq, pos, rnd) in enumerate(zip(seqs, positions, rounds)):
            key = (seq.request_id, seq.index, pos)
            if key[0] not in self.requests:
                continue
            if rnd == 1 or key not in self._partial:   # (a restart after a weight update)
                self._partial[key] = ([], [])
            states, gates = self._partial[key]
            states.append(hidden[j])
            gates.append(gate_logits[j])
            if rnd == self.num_rounds:
                done.append((key, self._partial.pop(key)))
        if done:
            self._captured.append(_Captured(
                [key for key, _ in done], torch.stack([torch.stack(h) for _, (h, _) in done]),
                torch.stack([torch.stack(g) for _, (_, g) in done]), weight_version))
            self.captured_tokens += len(done)
        self.seconds += time.perf_counter() - start

    # ------------------------------------------------------------------------------ records
    def flush(self) -> dict[str, torch.Tensor] | None:
        """Statistics of the tokens captured so far, then the columns (storage.ALL_FIELDS) of
        the requests finished so far, in the order they finished (None: none finished)."""
        start = time.perf_counter()
        self._compute()
        columns = self._emit()
        self.seconds += time.perf_counter() - start
        return columns

    def _compute(self) -> None:
        """The captured tokens' statistics, stored hidden states and `selected`, computed on
        the device and appended to the host columns."""
        if not self._captured:
            return
        captured, self._captured, self.captured_tokens = self._captured, [], 0
        keys = [key for c in captured for key in c.keys]
        hidden = torch.cat([c.hidden for c in captured])
        gates = torch.cat([c.gates for c in captured])
        columns = stats_of_hidden(hidden, gates, self.engine.runner.logits,
                                  self.engine.model_config.vocab_size)
        columns["hidden"] = self.stored_hidden(hidden)
        columns["selected"] = self._selected(keys, hidden, gates)
        columns = {k: v.cpu() for k, v in columns.items()}
        columns["weight_version"] = torch.tensor([c.version for c in captured for _ in c.keys])
        if self._host is not None:
            columns = concat_columns([self._host, columns])
            keys = self._host_keys + keys
        self._host, self._host_keys = columns, keys

    def _selected(self, keys: list[Key], hidden: torch.Tensor, gates: torch.Tensor
                  ) -> torch.Tensor:
        """The round each token's policy selects, asked as the teacher asks it (collect.py's
        _TeacherPolicy): after each round r < R with g_1..g_r and h_r, the first answer t >= r
        is kept; R where it never answers. int64 [m] on the device."""
        R, device = self.num_rounds, gates.device
        selected = torch.full((len(keys),), R, dtype=torch.int64, device=device)
        by_policy: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            by_policy.setdefault(self.requests[key[0]].policy, []).append(i)
        rounds_done = torch.arange(R, device=device)
        for name, rows in by_policy.items():
            policy = self.policy_of(name)
            index = to_device(rows, torch.int64, device)
            g, h = gates.index_select(0, index), hidden.index_select(0, index)
            replay = {rid: _ReplayRow(self.requests[rid].params)
                      for rid in {keys[i][0] for i in rows}}
            seqs = [replay[keys[i][0]] for i in rows]
            chosen = torch.zeros(len(rows), dtype=torch.int64, device=device)   # 0: not yet
            for r in range(1, R):
                info = RoundInfo(torch.full((len(rows),), r, dtype=torch.int64),
                                 g * (rounds_done < r), h[:, r - 1], seqs, R)
                target = policy.decide(info).to(device)
                chosen = torch.where((chosen == 0) & (target >= r), target, chosen)
            selected[index] = torch.where(chosen > 0, chosen, torch.full_like(chosen, R))
        return selected

    def _emit(self) -> dict[str, torch.Tensor] | None:
        """The finished requests' columns; the host keeps only unfinished requests' tokens."""
        if not self._finished:
            return None
        row_of = {key: i for i, key in enumerate(self._host_keys)}   # the latest capture wins
        rows, meta = [], {k: [] for k in ("token", "position", "output_index", "prompt_id",
                                          "sample_index", "seed")}
        for out in self._finished:
            req = self.requests.pop(out.request_id)
            params = out.sampling_params
            for comp in out.outputs:
                ids = comp.token_ids
                # Decode input i - 1 produced output token i >= 1; a sample that failed in its
                # last token's sampling (observed in full, token -1) has one input more.
                last = len(ids) - 1
                if comp.finish_reason == "error" and \
                        (out.request_id, comp.index, req.prompt_len + last) in row_of:
                    last += 1
                for i in range(1, last + 1):
                    key = (out.request_id, comp.index, req.prompt_len + i - 1)
                    if key not in row_of:
                        raise RuntimeError(f"the decode capture holds no rounds of request "
                                           f"{out.request_id!r} sample {comp.index} at "
                                           f"position {key[2]}")
                    rows.append(row_of[key])
                    meta["token"].append(ids[i] if i < len(ids) else -1)
                    meta["position"].append(key[2])
                    meta["output_index"].append(i)
                    meta["prompt_id"].append(req.prompt_id)
                    meta["sample_index"].append(comp.index)
                    meta["seed"].append(params.sample_seed(comp.index)
                                        if params.seed is not None else -1)
        self._finished = []
        columns = None
        if rows:   # (none where every sample ended at its first token)
            columns = {k: v.index_select(0, torch.tensor(rows)) for k, v in self._host.items()}
            columns.update({k: torch.tensor(v, dtype=torch.int64) for k, v in meta.items()})
            m, R = len(rows), self.num_rounds
            columns["round_mask"] = torch.ones(m, R, dtype=torch.bool)
            columns["executed"] = torch.full((m,), R, dtype=torch.int32)
            columns["ref_round"] = torch.full((m,), R, dtype=torch.int32)
        if self._host is not None:
            # kept: the latest capture of each unfinished request's tokens (a finished
            # request's tokens past its end, computed inside a token window, are dropped)
            keep = sorted(i for key, i in row_of.items() if key[0] in self.requests)
            self._host = {k: v.index_select(0, torch.tensor(keep, dtype=torch.int64))
                          for k, v in self._host.items()}
            self._host_keys = [self._host_keys[i] for i in keep]
        return columns
