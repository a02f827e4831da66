"""LoopConfig: the knobs of the rollout -> update -> evaluate loop, validated; LoopState: the
run's shared state that every step reads (below the steps, so they import no step)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence


GATE_WEIGHT, GATE_BIAS = "model.early_exit_gate.weight", "model.early_exit_gate.bias"
# Test hook (LoopConfig.inject_candidate): the candidate gate that validation judges in place of
# the trained one. "exit_round1": a bias so large that every token exits at round 1 at any
# threshold < 1 (a bad gate the update must reject); "current": the current gate itself (a
# neutral candidate it must accept). rltlab.loop.stage2.injected_candidate builds them.
INJECTED_CANDIDATES = ("exit_round1", "current")
# Stage II label kinds (rltlab.loop.stage2.stage2_targets): the paper's, the gain still to come,
# and either of them
GATE_LABELS = ("stage2", "remaining", "stage2_or_remaining")


@dataclass
class LoopConfig:
    iterations: int = 3
    # the task set (rltlab.loop.tasks): "embedded" (k-hop and word problems) or "gsm8k" (a
    # local JSONL at gsm8k_path, gsm8k_cot prompts with gsm8k_fewshot exemplars)
    tasks: str = "embedded"
    gsm8k_path: str | None = None
    gsm8k_fewshot: int = 3
    rollout_prompts: int = 64
    rollout_hops_share: float = 0.5    # embedded: k-hop problems among the rollouts (rest: word)
    rollout_threshold: float = 0.5
    max_tokens: int = 48
    eval_problems: int = 64
    thresholds: Sequence[float] = (0.3, 0.5, 0.7, 0.9, 1.0)
    depths: Sequence[int] = ()         # fixed depths, evaluated once at version 0 (the gate
    #                                    is never asked: no version can change them)
    min_loops: int = 1
    gate_steps: int = 200
    gate_lr: float = 3e-3
    gate_batch: int = 512
    slope: float = 50.0
    margin: float = 0.005
    gate_label: str = "stage2_or_remaining"   # Stage II labels (GATE_LABELS,
    #                                    rltlab.loop.stage2.stage2_targets): "stage2" the
    #                                    paper's (the gain round r made), "remaining" (the gain
    #                                    the rounds after r can still make), or either
    gate_val_fraction: float = 0.2     # prompts of the rollout held out to validate the gate
    gate_eval_every: int = 20          # validation BCE every this many steps (early stopping)
    gate_patience: int = 5             # stop after this many checks without improvement
    gate_keep_worse: bool = False      # True: push a candidate that fails validation anyway
    curve_z: float = 2.0               # confidence of the curve checks (z paired SE)
    gate_generation_check: bool = True  # a candidate that passed the trace checks is also
    #                                    generated with on the validation prompts (gate_check.py)
    gate_check_problems: int | None = 24   # ... at most this many of them (None: all; on the
    #                                    CPU each costs a prefill per threshold and gate)
    noninferiority_margin_pp: float = 5.0   # held-out verdict: "no worse" = every point's
    #                                    diff - z SE >= -margin (pp of exact match)
    inject_candidate: str | None = None     # test hook: replace the trained candidate gate
    #                                    (INJECTED_CANDIDATES)
    reuse_full_depth: bool = True      # copy, not regenerate, what the update cannot change:
    #                                    threshold 1.0 (fixed depth R) and a rejected update
    temperature: float = 0.0
    seed: int = 0
    hidden_dtype: str = "float32"
    # N+k lookahead exit predictor (rltlab.exit_predictor) trained on each iteration's traces
    train_exit_predictor: bool = False
    predictor_kind: str = "mlp"
    predictor_label: str = "argmax"
    predictor_epochs: int = 30
    predictor_decision_round: int = 1
    predictor_k: int = 2
    predictor_target_precision: float = 0.99
    lookahead_thresholds: Sequence[float] = ()   # evaluated besides the calibrated threshold
    # loop-aware draft head (rltlab.draft_heads) distilled on each iteration's traces
    train_draft_head: bool = False
    draft_kind: str = "residual_mlp"   # reuse-exact kinds: residual_mlp | lora_lm_head
    draft_rounds: int = 1
    draft_steps: int = 150
    draft_lr: float = 1e-3
    draft_k: int = 4
    draft_prompts: int = 8             # held-out word problems for tau / acceptance
    draft_max_tokens: int = 32
    draft_concurrency: int = 8
    # deployment: iteration k >= 1 rolls out with the N+2 predictor of iteration k - 1 as its
    # exit policy (on-policy traces, rltlab.loop.relabel) and measures it and the draft head of
    # iteration k - 1 (the engine's proposer) against stock Q-exit / target-only decoding in
    # the same run (rltlab.loop.deploy)
    deploy_components: bool = True
    crash_at_iteration: int = -1   # test hook: raise inside iteration k before it is committed
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_parameters(cls, namespace: dict[str, Any]) -> LoopConfig:
        """The config of a notebook's parameters: each field from the name that spells it in
        capitals (GATE_LR -> gate_lr), the fields without one at their defaults."""
        return cls(**{f.name: namespace[f.name.upper()] for f in fields(cls)
                      if f.name.upper() in namespace})

    def __post_init__(self):
        """Refuse settings the loop would trip over later, before anything is written."""
        for f in fields(self):      # gate_lr inf: Stage II went NaN; no knob takes NaN / inf
            value = getattr(self, f.name)
            items = list(value) if isinstance(value, (list, tuple)) else [value]
            for i, item in enumerate(items):
                if isinstance(item, float) and not math.isfinite(item):
                    where = f"{f.name}[{i}]" if isinstance(value, (list, tuple)) else f.name
                    raise ValueError(f"{where} must be finite, got {item!r}")
        if self.tasks not in ("embedded", "gsm8k"):
            raise ValueError(f"tasks must be 'embedded' or 'gsm8k', got {self.tasks!r}")
        if self.tasks == "gsm8k" and not self.gsm8k_path:
            raise ValueError("tasks 'gsm8k' needs gsm8k_path: a local JSONL of question / "
                             "answer records")
        if not 0.0 <= self.rollout_hops_share <= 1.0:
            raise ValueError(f"rollout_hops_share must lie in [0, 1], got "
                             f"{self.rollout_hops_share!r}")
        if not self.noninferiority_margin_pp >= 0:
            raise ValueError(f"noninferiority_margin_pp must be >= 0 (percentage points), got "
                             f"{self.noninferiority_margin_pp!r}")
        if self.gate_check_problems is not None and (
                isinstance(self.gate_check_problems, bool)
                or not isinstance(self.gate_check_problems, int) or self.gate_check_problems < 1):
            raise ValueError(f"gate_check_problems must be None or an int >= 1, got "
                             f"{self.gate_check_problems!r}")
        if self.gate_label not in GATE_LABELS:
            raise ValueError(f"gate_label must be one of {GATE_LABELS}, got {self.gate_label!r}")
        if self.inject_candidate is not None and self.inject_candidate not in INJECTED_CANDIDATES:
            raise ValueError(f"inject_candidate must be None or one of {INJECTED_CANDIDATES}, "
                             f"got {self.inject_candidate!r}")


# What a resumed run may change: the optimisation budget of the update steps (each iteration's
# result.json records the config it ran with; inject_candidate is a test hook like
# crash_at_iteration). Every other field defines what the iterations
# measure (rollout, Stage II labels, evaluation, add-ons) and must equal the finished ones'.
RESUMABLE_FIELDS = frozenset({
    "iterations", "crash_at_iteration", "gate_steps", "gate_lr", "gate_batch", "gate_eval_every",
    "gate_patience", "gate_keep_worse", "predictor_epochs", "draft_steps", "draft_lr",
    "inject_candidate"})


# What a finished iteration whose result.json predates a field ran with (the field's value
# before it existed), for the resume check; other missing fields are read as their defaults.
LEGACY_VALUES = {"gate_label": "stage2", "deploy_components": False, "gate_check_problems": None,
                 "tasks": "embedded", "gsm8k_path": None, "gsm8k_fewshot": 3}


class SimulatedCrash(RuntimeError):
    pass


class ResumeMismatch(ValueError):
    """A resumed loop whose parameters differ from its finished iterations' (by name)."""


@dataclass
class LoopState:
    run_dir: Path
    cfg: LoopConfig
    model: Any
    tokenizer: Any
    llm: Any
    model_dir: Path | None = None
    results: list[dict[str, Any]] = field(default_factory=list)
    resumed_from: int = 0
    problems: list[dict[str, Any]] = field(default_factory=list)
    load_average_start: list[float] | None = None   # os.getloadavg() when the run started
    check_engine_kwargs: dict = field(default_factory=dict)  # the gate check engine's LLM(...)
    check_llm: Any = None              # the gate check's private engine, made on first use
    warm_up: dict | None = None        # what the engine's warm-up did (seconds, graphs)
    speed_device: str | None = None    # where tok/s is measured: "cpu" or the GPU's name

    hashes: dict = field(default_factory=dict)   # weight version -> model hash (model_hash())

    def model_hash(self) -> str:
        """rltlab.model.checkpoint.model_hash of the model at the engine's weight version, once
        per version (only a gate push changes the model, and it moves the version): at the
        Ouro-1.4B shape each hash reads 2.9 GB back from the GPU."""
        version = self.llm.get_weight_version()
        if version not in self.hashes:
            from rltlab.model.checkpoint import model_hash
            self.hashes[version] = model_hash(self.model)
        return self.hashes[version]

    def gate_check_llm(self):
        """The gate check's private engine over a copy of the model (one per run)."""
        if self.check_llm is None:
            from rltlab.engine import LLM
            self.check_llm = LLM(self.model, self.tokenizer, **self.check_engine_kwargs)
        return self.check_llm
