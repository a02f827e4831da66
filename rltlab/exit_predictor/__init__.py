"""N+k lookahead exit predictors for looped LMs (docs/ouro.md): labels and features from
teacher-mode traces (features), the predictor and its checkpoint format (model), training with
calibration (train, `python -m rltlab.exit_predictor.train`), training traces (data) and
real-generation evaluation against the baselines (evaluate). The engine side lives in
rltlab.engine_patches.lookahead_exit. See docs/experiments/n_plus_2.md."""
from rltlab.exit_predictor.features import (LABEL_KINDS, build_features, label_spec,
                                            make_labels, oracle_rounds, prob_stats,
                                            trace_features)
from rltlab.exit_predictor.model import (ExitPredictor, load_predictor, read_predictor_manifest,
                                         save_predictor)

__all__ = ["LABEL_KINDS", "ExitPredictor", "build_features", "label_spec", "load_predictor",
           "make_labels", "oracle_rounds", "prob_stats", "read_predictor_manifest",
           "save_predictor", "trace_features"]
