"""The rollout -> gate update -> evaluate loop (notebook 10_rollout_update_evaluate).

Files: config (LoopConfig), tasks (the task set: embedded problems or GSM8K from a local JSONL),
stage2 (gate training, push), iteration (one iteration, resume),
addons (predictor / draft-head steps), deploy (what iteration k runs of iteration k - 1's
components), relabel (on-policy traces), gate_check (a candidate judged in generation), metrics
(curves, verdict, speed, metrics.json).

Iteration k (weight version k in the engine):
  1. rollout: generate on training-split problems (rltlab.loop.tasks: k-hop binding and word
     problems, `rollout_hops_share` of them k-hop, or the next window of GSM8K's training
     split). Iteration 0 (and every iteration without
     `deploy_components`) rolls out with the stock Q-exit, collecting traces in teacher mode
     (all R rounds per token, so every round has a Stage II label). With `deploy_components`,
     iteration k >= 1 rolls out with the N+2 predictor iteration k - 1 trained, acting
     (LAST_EXITED), and its traces are that rollout recomputed with every round
     (rltlab.loop.relabel): on-policy. The predictor and the draft head of k - 1 are then
     measured against the stock Q-exit and target-only decoding in the same run
     (rltlab.loop.deploy);
  2. update: Stage II gate-only training of the exit gate on those traces (docs/ouro.md,
     the exit gate): CE_r = -log p_r(round-R token), w_r = sigmoid(slope (I_r - margin)), BCE
     between 1 - lambda_r and w_r, with `gate_label` "stage2" I_r = max(0, CE_{r-1} - CE_r),
     round 1 taking w_2 (the paper's, as rltlab.pretrain.recipe.stage2_loss, which trains the
     embedded model's gate), "remaining" I_r = max(0, CE_r - min_{s>r} CE_s) (the gain the
     rounds after r can still make), or "stage2_or_remaining" (default: the larger w_r); the
     paper's candidate is trained beside any other as a reference.
     The traces are split by prompt into train / validation; the validation Stage II BCE is
     checked every `gate_eval_every` steps, the best step is kept (early stopping after
     `gate_patience` checks without improvement). The candidate is then validated against the
     current gate on the validation split: its BCE must not be higher and its teacher-forced
     quality-vs-depth curve (agreement of the exit round's top-1 with the round-R token vs
     mean exit round, Q-exit sweep) no worse by the z rule of rltlab.eval.curves. A candidate
     that fails is reported and, unless `gate_keep_worse`, the current gate is kept (pushed
     again, unchanged, as the next version). `inject_candidate` (a test hook) puts a bad or a
     neutral gate in the trained candidate's place;
  3. optional add-ons on the same traces, at version k (their checkpoints record version k
     and its model hash, which covers the gate): the N+k lookahead exit predictor
     (rltlab.exit_predictor, evaluated in real generation through
     rltlab.engine_patches.lookahead_exit and compared with the Q-exit at equal mean rounds)
     and the loop-aware draft head (rltlab.draft_heads, distilled on (h_d, p_R) of the traced
     tokens; tau / acceptance on held-out word problems vs the untrained shallow drafter);
  4. push: the new gate through the engine's weight-update API as version k + 1
     (start_weight_update / update_weights / finish_weight_update);
  5. evaluate: quality (and tok/s) vs mean executed rounds of the Q-exit threshold sweep at
     version k + 1 ("after"; "before" is version k: computed for k = 0, with the fixed
     `depths`, carried over after that) on held-out problems (disjoint from the training-split
     rollout prompts; checked), the paired comparison of the two Pareto curves
     (rltlab.eval.curves.compare_curves) and the verdict (metrics.gate_verdict): "no worse"
     at the declared `noninferiority_margin_pp`, "worse", "inconclusive", or "gate unchanged
     (candidate rejected)" when no candidate was pushed.

Checkpoints: everything of iteration k is built in RUN_DIR/.iter_k.tmp-*/ and renamed to
RUN_DIR/iter_k/ once complete (result.json, gate.safetensors, traces/, exit_predictor/,
draft_head/). A finished iteration is never recomputed: a re-run (same RUN_DIR) loads
iter_0..iter_{j} and resumes at j + 1 after pushing the last finished gate into the engine. A
crash leaves only a temporary directory, removed on the next run. A resume must use the
finished iterations' parameters and model (rltlab.loop.resume: only RESUMABLE_FIELDS, the
update steps' optimisation budget, may change); their result.json files are checked first.
"""
from rltlab.loop.addons import draft_head_step, exit_predictor_step, lookahead_row
from rltlab.loop.config import (GATE_BIAS, GATE_LABELS, GATE_WEIGHT, INJECTED_CANDIDATES,
                                LEGACY_VALUES, RESUMABLE_FIELDS, LoopConfig, LoopState,
                                ResumeMismatch, SimulatedCrash)
from rltlab.loop.deploy import (deploy_step, deployed_from, draft_engine_row, heldout_rows,
                                install_predictor, on_policy_rollout)
from rltlab.loop.relabel import all_round_states, on_policy_records, write_on_policy_traces
from rltlab.loop.iteration import (describe_iteration, evaluate, finished_iterations,
                                   iteration_dir, run_iteration, setup)
from rltlab.loop.tasks import rollout_problems
from rltlab.loop.resume import check_resume, read_result
from rltlab.loop.metrics import (UNCHANGED, VERDICTS, compare_evaluations, curves,
                                 depth_histograms, full_depth_row, gate_curve_report,
                                 gate_validation_curves, gate_verdict, loop_metrics, speedups)
from rltlab.loop.stage2 import (gate_state_of, injected_candidate, load_gate, push_weights,
                                save_gate, stage2_targets, trace_gate_curve, train_gate,
                                train_gate_on_traces)

__all__ = [
    "GATE_BIAS", "GATE_LABELS", "GATE_WEIGHT", "INJECTED_CANDIDATES", "LEGACY_VALUES",
    "LoopConfig", "LoopState", "RESUMABLE_FIELDS", "ResumeMismatch", "SimulatedCrash",
    "UNCHANGED", "VERDICTS", "all_round_states", "check_resume", "compare_evaluations", "curves",
    "deploy_step", "deployed_from", "depth_histograms", "describe_iteration", "draft_engine_row",
    "draft_head_step", "evaluate", "exit_predictor_step", "finished_iterations",
    "full_depth_row", "gate_curve_report", "gate_state_of", "gate_validation_curves",
    "gate_verdict", "heldout_rows", "injected_candidate", "install_predictor", "iteration_dir",
    "load_gate", "lookahead_row", "loop_metrics", "on_policy_records", "on_policy_rollout",
    "push_weights", "read_result", "rollout_problems", "run_iteration", "save_gate", "setup",
    "speedups", "stage2_targets", "trace_gate_curve", "train_gate", "train_gate_on_traces",
    "write_on_policy_traces",
]
