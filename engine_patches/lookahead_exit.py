"""N+k lookahead exit policy backed by a trained predictor (docs/ouro.md).

    from rltlab.engine_patches.lookahead_exit import install
    name = install(model, "runs/predictor/n1")         # checks the checkpoint against the model
    llm.generate(prompts, SamplingParams(exit_policy=name,
                                         exit_policy_args={"threshold": 0.8}))  # optional

After round N (the checkpoint's decision round) the predictor scores the token from h_N, the
gate logits g_1..g_N and the top-1 prob / margin / entropy of lm_head(h_N). If the calibrated
probability sigmoid(logit / T) reaches the threshold (the checkpoint's, or
exit_policy_args["threshold"]), the token commits to exit at min(N + k, max_loops): it runs
rounds N+1..N+k and is emitted from h_{N+k}; LAST_EXITED copies apply as for every exit.
Otherwise it continues (the policy answers "continue" until round max_loops, where every token
exits). Scoring runs on the model's device and the policy's decision_lag is k = exit - decision
round: the engine copies the answer to the host asynchronously and reads it only at round N + k,
so no round waits on a host sync for it (rltlab.engine.exit_policies).

Round 0 (a checkpoint with decision_round N = 0, k = 2): the engine asks the policy BEFORE
round 1 of each decode token (ExitPolicy.asks_before_round1) with h_0 = embed(token); the
features (exit_predictor.features.ROUND0_BLOCKS, as the manifest lists them) add the top-1 prob
/ margin / entropy of lm_head(h_prev), h_prev being the state the input token was sampled from
(Sequence.emit_hidden; the prefill's round-R state for the first decode token), and
optionally h_prev itself. Fire -> the token runs rounds 1 and 2 and is emitted from h_2
(LAST_EXITED copies into planes 3..R); else it continues to max_loops, or, with `then=` an
N >= 1 checkpoint, that predictor decides at its own round as usual. Every answer is read
lagged (decision_lag = k = 2: the round-0 answer at the end of round 2, the N = 1 answer at
the end of round 3), so no round waits on a host sync for it. A row whose previous emitting
state is unknown (e.g. tokens appended by speculative decoding) is not scored: it continues.

A checkpoint whose base-model hash, hidden size or number of rounds differs from the model is
refused with PredictorMismatchError (a ValueError) naming every mismatch; an N = 0 checkpoint
must also list valid round-0 feature blocks whose width matches the predictor.

Re-installing under a name that engines already use: an engine keeps the policy object its
factory returned, so `install` registers one InstalledPolicy per name and swaps the predictor
inside it; every live engine serves the new checkpoint from its next decision on (answers
already computed by the old one are still read). The new checkpoint is first checked against
the model config of every engine that uses the name, and refused if it does not fit one.
"""
from __future__ import annotations

import os
import weakref
from typing import Any

import torch

from rltlab.engine.exit_policies import (ExitPolicy, RoundInfo, available_exit_policies,
                                         register_exit_policy)
from rltlab.exit_predictor.features import (build_features, build_round0_features,
                                            check_round0_blocks, feature_names, prob_stats)
from rltlab.exit_predictor.model import ExitPredictor, load_predictor

DEFAULT_NAME = "n_plus_2"


class PredictorMismatchError(ValueError):
    """The predictor checkpoint was trained for another base model."""


def check_compatible(manifest: dict[str, Any], model=None, *, model_config=None,
                     model_hash: str | None = None) -> None:
    """Raise PredictorMismatchError unless the checkpoint fits the model: same base-model hash
    (rltlab.model.checkpoint.model_hash; needs `model` or `model_hash`), hidden size and R."""
    cfg = model_config if model_config is not None else getattr(model, "config", None)
    problems = []
    if model is not None and model_hash is None:
        from rltlab.model.checkpoint import model_hash as _hash
        model_hash = _hash(model)
    if model_hash is not None and manifest.get("base_model_hash") != model_hash:
        problems.append(f"base model hash {manifest.get('base_model_hash')!r} != the model's "
                        f"{model_hash!r} (trained for other weights or another dtype)")
    if cfg is not None:
        if manifest.get("hidden_size") != cfg.hidden_size:
            problems.append(f"hidden size {manifest.get('hidden_size')} != the model's "
                            f"{cfg.hidden_size}")
        if manifest.get("num_rounds") != cfg.num_rounds:
            problems.append(f"R = {manifest.get('num_rounds')} rounds != the model's "
                            f"{cfg.num_rounds}")
    if manifest.get("decision_round") == 0:
        problems += _round0_problems(manifest)
    if problems:
        raise PredictorMismatchError("exit-predictor checkpoint does not match the model: "
                                     + "; ".join(problems))


def _round0_problems(manifest: dict[str, Any]) -> list[str]:
    """What is wrong with an N = 0 checkpoint's round/feature description (empty if fine)."""
    feats, out = manifest.get("features") or {}, []
    if manifest.get("exit_round") != 2 or manifest.get("k") != 2:
        out.append(f"a round-0 predictor must exit at round 2 (k = 2), got exit round "
                   f"{manifest.get('exit_round')}, k {manifest.get('k')}")
    try:
        names = feature_names(int(manifest.get("hidden_size", 0)), 0,
                              check_round0_blocks(feats.get("blocks") or ()))
    except ValueError as err:
        return out + [f"round-0 features: {err}"]
    dims = {feats.get("dim"), (manifest.get("model") or {}).get("in_dim", len(names))}
    if dims != {len(names)}:
        out.append(f"round-0 features {feats.get('blocks')} have {len(names)} inputs, the "
                   f"checkpoint says {sorted(d for d in dims if d is not None)}")
    return out


class LookaheadExitPolicy(ExitPolicy):
    """See the module docstring. Stateless: one instance may serve several engines."""

    def __init__(self, predictor: ExitPredictor, manifest: dict[str, Any],
                 lm_head_weight: torch.Tensor, name: str = DEFAULT_NAME):
        self.name = name
        self.predictor = predictor.float().eval()
        self.manifest = manifest
        self.decision_round = int(manifest["decision_round"])
        self.exit_round = int(manifest["exit_round"])
        self.temperature = float(manifest["temperature"])
        self.threshold = float(manifest["threshold"])
        self.decision_lag = self.exit_round - self.decision_round
        if self.decision_lag < 1:
            raise ValueError(f"predictor exits at round {self.exit_round}, not after its "
                             f"decision round {self.decision_round}")
        self.lm_head_weight = lm_head_weight.detach().float().clone()
        self._scored, self._fired = 0, torch.zeros((), dtype=torch.int64)
        self._device: torch.device | None = None
        self.asks_before_round1 = self.decision_round == 0
        if self.asks_before_round1:
            self.blocks = check_round0_blocks(manifest["features"]["blocks"])
        self.then: LookaheadExitPolicy | None = None
        self.threshold_key = "threshold"    # "then_threshold" for a `then` predictor

    @property
    def decisions(self) -> dict[str, int]:
        """How many tokens were scored, and how many of them fired (reads the device)."""
        return {"scored": self._scored, "fired": int(self._fired)}

    def set_then(self, other: "LookaheadExitPolicy") -> None:
        """After a round-0 "continue", `other` (N >= 1, same lag) decides at its round."""
        if not self.asks_before_round1 or other.decision_round < 1 or \
                other.decision_lag != self.decision_lag:
            raise ValueError("then= needs a round-0 policy followed by an N >= 1 predictor with "
                             f"the same k (got N={self.decision_round} k={self.decision_lag}, "
                             f"then N={other.decision_round} k={other.decision_lag})")
        other.threshold_key = "then_threshold"
        self.then = other

    def _on(self, device: torch.device) -> None:
        # The three move together, once per device: the lm_head copy starts on the model's
        # device, the predictor where its checkpoint was loaded (often the CPU).
        if self._device != device:
            self.lm_head_weight = self.lm_head_weight.to(device)
            self.predictor = self.predictor.to(device)
            self._fired = self._fired.to(device)
            self._device = device

    def _threshold(self, params) -> float:
        return params.exit_policy_args.get(self.threshold_key, self.threshold)

    def validate(self, params, num_rounds):
        thr = self._threshold(params)
        if isinstance(thr, bool) or not isinstance(thr, (int, float)) or not 0 <= thr <= 1:
            raise ValueError(f"SamplingParams.exit_policy_args[{self.threshold_key!r}] must "
                             f"lie in [0, 1], got {thr!r}")
        if self.then is not None:
            self.then.validate(params, num_rounds)
        if num_rounds != self.manifest["num_rounds"]:
            raise ValueError(f"predictor trained for R={self.manifest['num_rounds']}, engine "
                             f"runs R={num_rounds}")

    @torch.no_grad()
    def score(self, hidden: torch.Tensor, gate_logits: torch.Tensor) -> torch.Tensor:
        """Calibrated probability [T] from h_N [T, H] and gate logits g_1..g_N [T, N], on
        hidden's device."""
        self._on(hidden.device)
        h = hidden.float()
        stats = prob_stats(h @ self.lm_head_weight.T)
        x = build_features(h, gate_logits.float(), stats)
        return torch.sigmoid(self.predictor(x) / self.temperature)

    @torch.no_grad()
    def score_round0(self, embed: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        """Calibrated probability [T] from h_0 = embed(token) [T, H] and the state the token was
        sampled from [T, H] (features.ROUND0_BLOCKS), on embed's device."""
        self._on(embed.device)
        prev = prev_hidden.float()
        x = build_round0_features(embed.float(), prob_stats(prev @ self.lm_head_weight.T), prev,
                                  self.blocks)
        return torch.sigmoid(self.predictor(x) / self.temperature)

    def _decide_round0(self, info: RoundInfo) -> torch.Tensor:
        targets = torch.zeros(len(info.seqs), dtype=torch.int64, device=info.device)
        rows = [i for i, (r, seq) in enumerate(zip(info.rounds.tolist(), info.seqs))
                if r == 0 and seq.emit_hidden is not None
                and seq.emit_hidden[0] == seq.num_output_tokens - 1]
        if rows:
            idx = info.per_row(rows, torch.int64)   # pinned: no wait for the device
            prev = torch.stack([info.seqs[i].emit_hidden[1] for i in rows]).to(info.device)
            probs = self.score_round0(info.hidden[idx], prev)
            self._fire(info, rows, idx, probs, targets)
        return targets

    def _fire(self, info, rows, idx, probs, targets) -> None:
        params = [info.seqs[i].params for i in rows]
        threshold = info.per_row([float(self._threshold(p)) for p in params])
        exit_at = info.per_row([min(self.exit_round, p.max_loops) for p in params], torch.int64)
        fire = probs >= threshold
        targets[idx] = torch.where(fire, exit_at, torch.zeros_like(exit_at))
        self._scored += len(rows)
        self._fired += fire.sum()

    def decide(self, info: RoundInfo) -> torch.Tensor:
        """Round 0 (N = 0 only): rows get 2 if their round-0 score fires, else 0; later
        rounds: `then`'s answers, or 0. N >= 1: """
        if self.asks_before_round1:
            if bool((info.rounds == 0).all()):
                return self._decide_round0(info)
            if self.then is None:
                return torch.zeros(len(info.seqs), dtype=torch.int64, device=info.device)
            return self.then.decide(info)
        return self._decide_rounds(info)

    def _decide_rounds(self, info: RoundInfo) -> torch.Tensor:
        """Rows at the decision round get min(exit round, max_loops) if their score reaches the
        threshold, else 0 (continue); every other row gets 0. A device tensor, read lagged."""
        rows = [i for i, r in enumerate(info.rounds.tolist()) if r == self.decision_round]
        targets = torch.zeros(len(info.seqs), dtype=torch.int64, device=info.device)
        if rows:
            idx = info.per_row(rows, torch.int64)   # pinned: no wait for the device
            probs = self.score(info.hidden[idx], info.gate_logits[idx, : self.decision_round])
            self._fire(info, rows, idx, probs, targets)
        return targets


def load_policy(checkpoint: str | os.PathLike, model, *, name: str = DEFAULT_NAME,
                model_hash: str | None = None) -> LookaheadExitPolicy:
    """Load a predictor checkpoint for `model` (refused with PredictorMismatchError if it does
    not match: hash, hidden size, R)."""
    predictor, manifest = load_predictor(checkpoint)
    check_compatible(manifest, model, model_hash=model_hash)
    return LookaheadExitPolicy(predictor, manifest, model.lm_head.weight, name)


class InstalledPolicy(ExitPolicy):
    """The policy engines get for an installed name: delegates to the current
    LookaheadExitPolicy, which a re-install replaces (see the module docstring)."""

    def __init__(self, name: str, current: LookaheadExitPolicy):
        self._name, self.current = name, current
        self._configs: list[weakref.ref] = []   # model configs of the engines using it

    def add_engine_config(self, model_config) -> None:
        self._configs = [ref for ref in self._configs if ref() is not None]
        self._configs.append(weakref.ref(model_config))

    name = property(lambda self: self._name)
    decision_lag = property(lambda self: self.current.decision_lag)
    asks_before_round1 = property(lambda self: self.current.asks_before_round1)

    def replace(self, policy: LookaheadExitPolicy) -> None:
        for ref in self._configs:   # validate for every engine's model before switching
            if ref() is not None:
                check_compatible(policy.manifest, model_config=ref())
        self.current = policy

    def validate(self, params, num_rounds):
        self.current.validate(params, num_rounds)

    def decide(self, info):
        return self.current.decide(info)

    def __getattr__(self, attr):   # manifest, threshold, score, decisions, ...
        if attr == "current":      # not set yet (copy / unpickle): no recursion
            raise AttributeError(attr)
        return getattr(self.current, attr)


_INSTALLED: dict[str, InstalledPolicy] = {}


def install(model, checkpoint: str | os.PathLike, *, name: str = DEFAULT_NAME,
            model_hash: str | None = None, overwrite: bool = True,
            then: str | os.PathLike | None = None) -> str:
    """Load + check the checkpoint and register the policy under `name` (returned). The
    factory re-checks hidden size and R against the engine's model config. `then`: an N >= 1
    checkpoint that decides for tokens a round-0 checkpoint let continue. Installing again
    under a name in use switches every engine that uses it to the new checkpoint."""
    if not overwrite and name in available_exit_policies():
        raise ValueError(f"exit policy {name!r} is already registered (pass overwrite=True)")
    policy = load_policy(checkpoint, model, name=name, model_hash=model_hash)
    if then is not None:
        policy.set_then(load_policy(then, model, name=name, model_hash=model_hash))
    installed = _INSTALLED.get(name)
    if installed is None:
        installed = InstalledPolicy(name, policy)
    else:
        installed.replace(policy)

    def factory(model_config, **_kwargs):
        check_compatible(installed.current.manifest, model_config=model_config)
        installed.add_engine_config(model_config)
        return installed
    register_exit_policy(name, factory, overwrite=overwrite)
    _INSTALLED[name] = installed
    return name
