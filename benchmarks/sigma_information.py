"""What the served ``sigma`` says that 1/u does not, measured on the default adapter's committed raw outputs
(``benchmarks/results/decision_scores/default.json``, torch-fp32, the version they were computed with):

    python -m benchmarks.sigma_information [--output benchmarks/results/sigma_information.json]

Per question, sigma is summarised by its mean over the options. Reported per stream: Spearman's rank correlation
of mean sigma with the total evidence alpha0 (and with 1/u = alpha0 / C); the OOD AUROC of 1/u and of mean sigma
(in-distribution SciQ as the positive class; sigma's direction chosen on the validation streams) for each shifted
stream; and whether sigma adds to 1/u: a logistic regression on (log 1/u, log mean sigma) fitted on the validation
streams (SciQ validation against the ``_dev`` shifted streams) and scored on the test streams, beside 1/u alone.
Nothing here is tuned on the test streams.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score

from benchmarks.common import write_result
from ibedl.core.artifact import read_manifest
from ibedl.training.calibrate import posthoc_outputs

SCORES = Path("benchmarks/results/decision_scores/default.json")
SHIFTED = ("sciq_no_passage", "obqa", "arc_easy", "arc_challenge", "race_no_article")


def features(stream: dict, kind: str, offset: float, head: dict) -> dict:
    """Per question: alpha0 and 1/u = alpha0 / (C offset) as served (after the post-hoc map, in float64, as
    calibration computes them), and mean sigma."""
    outputs = posthoc_outputs(kind, {**stream, "offset": offset}, head)
    inv_u = 1.0 / np.asarray(outputs.uncertainty)
    counts = np.asarray([len(a) for a in stream["alpha"]])
    return {"alpha0": inv_u * counts * offset, "inv_u": inv_u,
            "sigma": np.asarray([float(np.mean(s)) for s in stream["sigma"]])}


def pair(f: dict) -> np.ndarray:
    """A stream's features as (n, 2): log 1/u, log mean sigma (what the combined model reads)."""
    return np.c_[np.log(f["inv_u"]), np.log(f["sigma"])]


def auroc(positive: np.ndarray, negative: np.ndarray) -> float:
    y = np.r_[np.ones(len(positive)), np.zeros(len(negative))]
    return float(roc_auc_score(y, np.r_[positive, negative]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sigma_information",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="benchmarks/results/sigma_information.json")
    args = parser.parse_args(argv)
    dump = json.loads(SCORES.read_text())
    head = read_manifest(Path(dump["artifact"])).head  # the served zeta of the torch-fp32 calibration
    feats = {name: features(s, dump["kind"], dump["offset"], head) for name, s in dump["streams"].items()}
    rank = {name: {"spearman_sigma_alpha0": float(spearmanr(f["sigma"], f["alpha0"]).statistic),
                   "spearman_sigma_inv_u": float(spearmanr(f["sigma"], f["inv_u"]).statistic),
                   "questions": int(len(f["sigma"]))} for name, f in feats.items()}
    # sigma's direction as an in-distribution score, chosen on the validation streams
    val_id, test_id = feats["sciq_validation"], feats["sciq_test"]
    dev = [feats[f"{s}_dev"] for s in SHIFTED]
    sign = 1.0 if np.mean([auroc(val_id["sigma"], d["sigma"]) for d in dev]) >= 0.5 else -1.0

    x = np.concatenate([pair(val_id), *(pair(d) for d in dev)])
    y = np.concatenate([np.ones(len(val_id["sigma"])), *(np.zeros(len(d["sigma"])) for d in dev)])
    combined = LogisticRegression(class_weight="balanced").fit(x, y)
    ood = {}
    for s in SHIFTED:
        shifted = feats[s]
        ood[s] = {"auroc_inv_u": auroc(test_id["inv_u"], shifted["inv_u"]),
                  "auroc_sigma": auroc(sign * test_id["sigma"], sign * shifted["sigma"]),
                  "auroc_inv_u_and_sigma": auroc(combined.decision_function(pair(test_id)),
                                                 combined.decision_function(pair(shifted)))}
        ood[s]["gain_of_sigma_over_inv_u"] = ood[s]["auroc_inv_u_and_sigma"] - ood[s]["auroc_inv_u"]
    gains = [v["gain_of_sigma_over_inv_u"] for v in ood.values()]
    result = {
        "command": "python -m benchmarks.sigma_information " + " ".join(argv if argv is not None else sys.argv[1:]),
        "outputs": str(SCORES), "artifact_version": dump["version"], "served_head": head,
        "sigma_summary": "mean over the options", "sigma_direction": "higher is in-distribution" if sign > 0 else
        "lower is in-distribution", "rank_correlation": rank, "ood": ood,
        "combined_model": {"fitted_on": "sciq_validation against the _dev shifted streams",
                           "coefficients": {"log_inv_u": float(combined.coef_[0][0]),
                                            "log_sigma": float(combined.coef_[0][1])}},
        "mean_gain_of_sigma_over_inv_u": float(np.mean(gains)), "max_gain_of_sigma_over_inv_u": float(np.max(gains)),
    }
    write_result(args.output, result)
    print(json.dumps({k: result[k] for k in ("rank_correlation", "ood", "mean_gain_of_sigma_over_inv_u")},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
