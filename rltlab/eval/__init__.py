"""Evaluation: metrics (paired differences, depth, speed) and tasks (arithmetic, text
perplexity, GSM8K gsm8k_cot). See docs/workbench.md."""
from rltlab.eval.metrics import (PairedDifference, decode_depths, depth_histogram, depth_stats,
                                 mean_with_se, paired_difference, timing_records, timing_stats,
                                 token_agreement)
from rltlab.eval.gsm8k import (evaluate_gsm8k, gsm8k_cot_prompt, gsm8k_is_correct,
                               gsm8k_strict_match)
from rltlab.eval.tasks import (GenOutput, as_gen_output, engine_generate_fn, evaluate_arithmetic,
                               plain_generate_fn, text_perplexity)

__all__ = [
    "PairedDifference", "decode_depths", "depth_histogram", "depth_stats", "mean_with_se",
    "paired_difference", "timing_records", "timing_stats", "token_agreement", "GenOutput",
    "as_gen_output",
    "engine_generate_fn", "evaluate_arithmetic", "evaluate_gsm8k", "gsm8k_cot_prompt",
    "gsm8k_is_correct", "gsm8k_strict_match", "plain_generate_fn", "text_perplexity",
]
