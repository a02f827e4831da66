"""LoopConfig: the knobs of the rollout -> update -> evaluate loop, validated; LoopState: the
run's shared state that every step reads (below the steps, so they import no step)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence


GATE_WEIGHT, GATE_BIAS = "model.early_exit_gate.weight", "model.early_exit_gate.bias"


@dataclass
class LoopConfig:
    iterations: int = 3
    rollout_prompts: int = 64
    rollout_threshold: float = 0.5
    max_tokens: int = 48
    eval_problems: int = 64
    thresholds: Sequence[float] = (0.3, 0.5, 0.7, 0.9, 1.0)
    min_loops: int = 1
    gate_steps: int = 200
    gate_lr: float = 3e-3
    gate_batch: int = 512
    slope: float = 50.0
    margin: float = 0.005
    gate_val_fraction: float = 0.2     # prompts of the rollout held out to validate the gate
    gate_eval_every: int = 20          # validation BCE every this many steps (early stopping)
    gate_patience: int = 5             # stop after this many checks without improvement
    gate_keep_worse: bool = False      # True: push a candidate that fails validation anyway
    curve_z: float = 2.0               # "no worse" = no point lower by more than z paired SE
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
    draft_prompts: int = 8             # held-out arithmetic prompts for tau / acceptance
    draft_max_tokens: int = 32
    draft_concurrency: int = 8
    crash_at_iteration: int = -1   # test hook: raise inside iteration k before it is committed
    extra: dict = field(default_factory=dict)


# What a resumed run may change: the optimisation budget of the update steps (each iteration's
# result.json records the config it ran with). Every other field defines what the iterations
# measure (rollout, Stage II labels, evaluation, add-ons) and must equal the finished ones'.
RESUMABLE_FIELDS = frozenset({
    "iterations", "crash_at_iteration", "gate_steps", "gate_lr", "gate_batch", "gate_eval_every",
    "gate_patience", "gate_keep_worse", "predictor_epochs", "draft_steps", "draft_lr"})


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
