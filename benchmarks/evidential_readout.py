"""How well an evidential read-out of a MAP adapter's own option logits can be calibrated.

    python -m benchmarks.evidential_readout [--artifact artifacts/map] [--split validation] [--limit 500]
        [--output benchmarks/results/evidential_readout_map_stage1.json]

The adapter (a softmax head) answers SciQ questions once. Its option logits z (B, C), centred per question,
are then read out twice: as the softmax the adapter was trained for, and as the Dirichlet mean of an
evidential head, alpha = softplus(s * z) + 1, p = alpha / alpha0, for a grid of evidence scales s (what
``centre_options`` with ``evidence_scale`` s computes from the same features). Accuracy is the same for every
read-out (both are monotone in z); the best scale's NLL and ECE are what an IB-EDL head could reach if it
kept the MAP adapter's features and only changed how they become probabilities.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.common import write_result
from ibedl.core.dirichlet import alpha_from_logits, dirichlet_outputs
from ibedl.core.predictor import Predictor
from ibedl.training import metrics
from ibedl.training.data import load_dataset
from ibedl.training.evaluate import predict_all

SCALES = (1, 2, 4, 6, 8, 12, 16, 24, 32)


def evidential_probs(probs: list[list[float]], scale: float) -> list[list[float]]:
    """Softmax outputs (per question, C each) -> the Dirichlet mean of softplus(scale * centred z) + 1."""
    out = []
    for p in probs:
        z = torch.log(torch.tensor(p, dtype=torch.float64).clamp_min(1e-300)).unsqueeze(0)  # z up to a constant
        z = z - z.mean(-1, keepdim=True)
        out.append(dirichlet_outputs(alpha_from_logits(scale * z)).probs[0].tolist())
    return out


def summary(probs, labels) -> dict:
    """The calibration part of ``ibedl.training.metrics.summarise``."""
    full = metrics.summarise(probs, labels)
    return {k: full[k] for k in ("accuracy", "ece", "nll", "brier", "mean_confidence")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", default="artifacts/map")
    parser.add_argument("--dataset", default="sciq")
    parser.add_argument("--split", default="validation")
    parser.add_argument("--limit", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--output", default="benchmarks/results/evidential_readout_map_stage1.json")
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 10:
        parser.error(f"--limit must be at least 10, got {args.limit}")
    predictor = Predictor.from_artifact(args.artifact)
    if predictor.head.config.kind != "softmax":
        parser.error(f"--artifact must hold a softmax-head (MAP) adapter, got head kind {predictor.head.config.kind!r}")
    questions = load_dataset(args.dataset, args.split, limit=args.limit, seed=0)
    predictions, _ = predict_all(predictor, questions, args.batch_size)
    probs = [p.probs for p in predictions]
    labels = [q.answer for q in questions]
    readouts = {"softmax": summary(probs, labels)}
    for s in SCALES:
        readouts[f"evidential_s{s}"] = summary(evidential_probs(probs, s), labels)
    best = min((k for k in readouts if k != "softmax"), key=lambda k: readouts[k]["nll"])
    write_result(args.output, {
        "artifact": args.artifact, "dataset": args.dataset, "split": args.split, "n": len(questions),
        "readouts": readouts, "best_evidential_by_nll": best,
        "nll_ratio_best_evidential_to_softmax": readouts[best]["nll"] / readouts["softmax"]["nll"],
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
