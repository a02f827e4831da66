"""Which tokens leave after each round: fixed spans, max_loops, committed plans, lagged answers
and the exit policies' answers (rltlab.engine.exit_policies), for one LLMEngine.

Host syncs only where a policy needs them: gate logits are kept in a device-side history
(one row per running sequence) for policies with reads_gates, and the answers of lagged
policies (decision_lag >= 1) are copied to pinned host memory asynchronously and read
decision_lag rounds later (sequence.PendingDecision).
"""
from __future__ import annotations

import torch

from rltlab.engine.exit_policies import RoundInfo
from rltlab.common.device import tensor_to_device, to_device
from rltlab.engine.model_runner import StepRows
from rltlab.engine.sequence import PendingDecision, Sequence


class ExitDecider:
    def __init__(self, engine, max_num_seqs: int):
        self.engine = engine
        # g_1..g_R of every running decode token, one row per sequence (rows are handed out
        # on first use and returned when the sequence finishes).
        self.gate_history = torch.zeros(max_num_seqs, engine.num_rounds, dtype=torch.float32,
                                        device=engine.runner.device)
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))

    def release(self, seq: Sequence) -> None:
        if seq.gate_row is not None:
            self._free_rows.append(seq.gate_row)
            seq.gate_row = None

    def decide(self, seqs, batch: StepRows, hidden, gate_logits) -> torch.Tensor:
        """bool [T] on the host: which tokens leave after this round (fixed spans: their
        recorded exit; decode tokens: max_loops, a committed plan, a lagged answer that is due
        now, or their policy's answer now). Reads the device only for policies that need it."""
        exits = torch.zeros(len(batch.slot_list), dtype=torch.bool)
        asking: dict[str, list[tuple[int, Sequence]]] = {}
        gate_rows: list[tuple[int, Sequence]] = []
        for seq, lo in zip(seqs, batch.offsets):
            span, rnd = seq.span, seq.span.round + 1
            if span.exit_rounds is not None:
                exits[lo: lo + span.num_active] = span.exit_rounds[span.active] == rnd
                continue
            if self.engine.select_only:   # all rounds run; the output round is chosen at R
                exits[lo] = rnd == self.engine.num_rounds
                continue
            policy = self.engine.policy(seq.params.exit_policy)
            if policy.reads_gates:
                gate_rows.append((lo, seq))
            self._read_due_decisions(seq, rnd)
            if rnd >= min(self.engine.num_rounds, seq.params.max_loops) or span.planned_exit == rnd:
                exits[lo] = True
            elif span.planned_exit is None and seq.seq_id not in self.engine._failed:
                asking.setdefault(policy.name, []).append((lo, seq))
        if gate_rows:
            self._record_gates(gate_rows, gate_logits)
        for name, rows in asking.items():
            self._ask_policy(self.engine.policy(name), rows, hidden, exits)
        return exits

    def ask_before_round1(self, seqs) -> None:
        """Round-0 ask: decode tokens about to run round 1 whose policy has asks_before_round1
        get its answer deferred like any lagged answer (read at the end of round
        decision_lag; no host sync here). RoundInfo: rounds 0, hidden h_0 = embed(token)."""
        asking: dict[str, list[Sequence]] = {}
        for seq in seqs:
            span = seq.span
            if span.exit_rounds is not None or span.round != 0 or span.planned_exit is not None:
                continue
            policy = self.engine.policy(seq.params.exit_policy)
            if getattr(policy, "asks_before_round1", False) and policy.decision_lag >= 1:
                asking.setdefault(policy.name, []).append(seq)
        for name, rows in asking.items():
            policy = self.engine.policy(name)
            ids = [seq.token_ids(seq.span.start, seq.span.start + 1)[0] for seq in rows]
            runner = self.engine.runner
            h0 = runner.model.model.embed_tokens(to_device(ids, torch.int64, runner.device))
            info = RoundInfo(torch.zeros(len(rows), dtype=torch.int64), None, h0, rows,
                             self.engine.num_rounds)
            try:
                targets = policy.decide(info)
                if len(targets) != len(rows):
                    raise RuntimeError(f"returned {len(targets)} targets for {len(rows)} rows")
            except Exception as err:
                for seq in rows:
                    self.engine._failed[seq.seq_id] = (f"exit policy {policy.name!r} failed "
                                                       f"before round 1: {err!r}")
                continue
            self._defer(policy, [(None, seq) for seq in rows], [0] * len(rows), targets)

    def _record_gates(self, rows, gate_logits) -> None:
        """g_r of each decode token into its sequence's row of the device gate history."""
        for _, seq in rows:
            if seq.gate_row is None:
                seq.gate_row = self._free_rows.pop()
        dev = gate_logits.device
        tokens = to_device([lo for lo, _ in rows], torch.int64, dev)
        hist_rows = to_device([seq.gate_row for _, seq in rows], torch.int64, dev)
        cols = to_device([seq.span.round for _, seq in rows], torch.int64, dev)
        self.gate_history[hist_rows, cols] = gate_logits[tokens]

    def _read_due_decisions(self, seq: Sequence, rnd: int) -> None:
        span = seq.span
        due = [p for p in span.pending if p.due_round == rnd]
        if not due:
            return
        span.pending = [p for p in span.pending if p.due_round != rnd]
        for decision in due:
            target = decision.read()
            if target == 0 or span.planned_exit is not None:
                continue
            if rnd <= target <= self.engine.num_rounds:
                span.planned_exit = target
            else:
                self.engine._failed[seq.seq_id] = (
                    f"exit policy {decision.policy!r} answered round {target} after round "
                    f"{decision.asked_round} (its decision_lag promises >= {decision.due_round})")

    def _ask_policy(self, policy, rows, hidden, exits) -> None:
        rounds = torch.tensor([seq.span.round + 1 for _, seq in rows])
        gates = None
        if policy.reads_gates:
            hist_rows = to_device([seq.gate_row for _, seq in rows], torch.int64, hidden.device)
            done = torch.arange(self.engine.num_rounds)[None, :] < rounds[:, None]
            gates = self.gate_history[hist_rows] * tensor_to_device(done, hidden.device)
        info = RoundInfo(rounds, gates, hidden, [seq for _, seq in rows], self.engine.num_rounds,
                         source_rows=[lo for lo, _ in rows])
        try:
            targets = policy.decide(info)
            if len(targets) != len(rows):
                raise RuntimeError(f"returned {len(targets)} targets for {len(rows)} rows")
            if policy.decision_lag > 0:
                self._defer(policy, rows, rounds.tolist(), targets)
                return
            targets = targets.tolist()
        except Exception as err:  # isolate the failing request(s): retry one row at a time
            if len(rows) > 1:
                for row in rows:
                    self._ask_policy(policy, [row], hidden, exits)
            else:
                self.engine._failed[rows[0][1].seq_id] = (f"exit policy {policy.name!r} "
                                                          f"failed: {err!r}")
            return
        for (lo, seq), target, rnd in zip(rows, targets, rounds.tolist()):
            if target == rnd:
                exits[lo] = True
            elif target > rnd and target <= self.engine.num_rounds:
                seq.span.planned_exit = int(target)
            elif target != 0:
                self.engine._failed[seq.seq_id] = (f"exit policy {policy.name!r} answered round "
                                            f"{target} after round {rnd}")

    def _defer(self, policy, rows, rounds: list[int], targets: torch.Tensor) -> None:
        """Start the device->host copy of a lagged policy's answers; read decision_lag rounds
        later (PendingDecision.read), so this round's work never waits for the host."""
        ready = None
        if targets.device.type == "cuda":
            host = torch.empty(targets.shape, dtype=targets.dtype, pin_memory=True)
            host.copy_(targets, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host = targets
        for i, ((_, seq), rnd) in enumerate(zip(rows, rounds)):
            seq.span.pending.append(PendingDecision(rnd + policy.decision_lag, rnd, policy.name,
                                                    host, i, ready))
