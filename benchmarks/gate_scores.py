"""Which OOD score should the served gate read? Each candidate's AUROC on validation splits only.

    python -m benchmarks.gate_scores --artifact artifacts/default [--fit 200] [--id 200] [--shifted 60]
        [--output benchmarks/results/gate_scores.json]

In-distribution: the adapter's SciQ validation questions, split in two: the first ``--fit`` fit the Mahalanobis
score's class-conditional Gaussians (the calibration sample), the next ``--id`` are the positive class. Shifted: the
validation split of each stream the grid tests on (SciQ without its passage, OBQA, ARC-E, ARC-C, RACE without its
article), ``--shifted`` questions each. Scores (higher: more in-distribution): max probability (MP), 1/u (UM, Dirichlet
heads), energy (logsumexp of the option logits) and Mahalanobis distance of the head's hidden state
(``ibedl.training.ood_scores``), all from one forward pass. The gate should rest on the score with the best mean
AUROC over the streams, chosen here without reading any test split.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from benchmarks.common import write_result

STREAMS = ("sciq:no_context", "obqa", "arc_easy", "arc_challenge", "race:no_context")


def scores(predictor, questions, maha, batch_size: int) -> dict[str, np.ndarray]:
    """Every candidate score of ``questions`` (None for UM without a Dirichlet)."""
    from ibedl.training.evaluate import predict_all
    from ibedl.training.ood_scores import features

    preds, _ = predict_all(predictor, questions, batch_size, progress=False)
    energy, hidden = features(predictor, questions, batch_size)
    out = {"mp": np.array([p.confidence for p in preds]), "energy": energy, "maha": maha.score(hidden)}
    if preds[0].uncertainty is not None:
        out["um"] = np.array([1.0 / p.uncertainty for p in preds])
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gate_scores", description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", default="artifacts/default")
    parser.add_argument("--dataset", default="sciq", help="the adapter's in-distribution dataset")
    parser.add_argument("--fit", type=int, default=200, help="validation questions that fit the Mahalanobis score")
    parser.add_argument("--id", type=int, default=200, help="validation questions of the positive class")
    parser.add_argument("--shifted", type=int, default=60, help="validation questions of each shifted stream")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--output", default="benchmarks/results/gate_scores.json")
    args = parser.parse_args(argv)
    for name in ("fit", "id", "shifted"):
        if getattr(args, name) < 10:
            parser.error(f"--{name} must be at least 10, got {getattr(args, name)}")
    from ibedl.core.predictor import Predictor
    from ibedl.training import metrics
    from ibedl.training.data import load_dataset
    from ibedl.training.experiments.evaluate_run import load_eval_set
    from ibedl.training.ood_scores import Mahalanobis, features

    predictor = Predictor.from_artifact(args.artifact)
    validation = load_dataset(args.dataset, "validation", limit=args.fit + args.id, seed=0)
    fit_q, id_q = validation[: args.fit], validation[args.fit :]
    maha = Mahalanobis.fit(features(predictor, fit_q, args.batch_size)[1], [q.answer for q in fit_q])
    positive = scores(predictor, id_q, maha, args.batch_size)
    streams = {}
    for spec in STREAMS:
        negative = scores(predictor, load_eval_set(spec, args.shifted, split="validation"), maha, args.batch_size)
        streams[spec] = {k: metrics.auroc(positive[k], negative[k]) for k in positive if k in negative}
        print(spec, " ".join(f"{k} {v:.3f}" for k, v in streams[spec].items()), flush=True)
    names = list(next(iter(streams.values())))
    mean = {k: float(np.mean([s[k] for s in streams.values()])) for k in names}
    result = {"artifact": args.artifact, "split": "validation", "n_fit": len(fit_q), "n_id": len(id_q),
              "n_shifted": args.shifted, "mahalanobis_shrinkage": maha.shrinkage, "auroc": streams, "mean_auroc": mean,
              "best": max(mean, key=mean.get)}
    write_result(args.output, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
