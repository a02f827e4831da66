"""Issue 16, tenth session: how much one round-1 predictor's operating point moves with its
training seed, and what averaging seeds does (the reason for `train --members`).

    python docs/experiments/scripts/n_plus_2_seed_variance.py --traces /tmp/s10/traces \
        --out docs/experiments/data/2026-12-03-n_plus_2-v4-seed-variance.json

The same traces, greedy downstream labels (exit round 3), features, splits and calibration as
`python -m rltlab.exit_predictor.train --rounds 1 --model mlp --label downstream
--target-precision 0.99` (seed 0 there is seed 0 here); for seeds 0..S-1 one MLP each, then the
mean of the first m of them for m = 1..S. Per predictor: the calibrated threshold and the test
split's precision, recall, AUC and fire rate at it. CPU, fp32, 1 thread. Last line: JSON.
"""
import argparse
import json

import torch

from rltlab.common.atomic import write_json_atomic
from rltlab.exit_predictor.calibration import binary_metrics, calibrate, split_by_prompt
from rltlab.exit_predictor.features import label_spec, make_labels, trace_features
from rltlab.exit_predictor.fit import predict_logits, train_predictor
from rltlab.exit_predictor.model import ExitPredictor
from rltlab.exit_predictor.train import _with_downstream, load_training_data


def operating_point(logits, y, calib, test, precision):
    _, probs, threshold, reached = calibrate(logits, y, calib, precision)
    return {"threshold": threshold, "target_reached": reached,
            **binary_metrics(probs[test], y[test], threshold)}


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--target-precision", type=float, default=0.99)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tr, _ = load_training_data(args.traces)
    labelled, spec = _with_downstream(tr, args.traces, 3, label_spec("downstream"))
    y = make_labels(labelled, 3, spec)
    x = trace_features(tr, 1)
    train, calib, test = split_by_prompt(tr["prompt_id"], seed=0)
    nets, rows = [], []
    for seed in range(args.seeds):
        net, _ = train_predictor(x[train], y[train], kind="mlp", hidden=64, seed=seed, cpu=True)
        nets.append(net)
        for kind, predictor in (("seed", net), ("mean of seeds", ExitPredictor.ensemble(nets))):
            point = operating_point(predict_logits(predictor, x), y, calib, test,
                                    args.target_precision)
            rows.append({"kind": kind, "seeds": [seed] if kind == "seed" else
                         list(range(seed + 1)), **point})
            print(f"{kind:>13} {rows[-1]['seeds']}: recall {point['recall']:.3f} precision "
                  f"{point['precision']:.3f} AUC {point['auc']:.3f} fire {point['fire_rate']:.3f}")
    result = {"traces": args.traces, "label": spec, "target_precision": args.target_precision,
              "command": "python docs/experiments/scripts/n_plus_2_seed_variance.py --traces "
                         f"{args.traces} --out {args.out}", "rows": rows}
    write_json_atomic(args.out, result)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
