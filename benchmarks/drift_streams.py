"""Which traffic moves the served uncertainty mass u: KS and PSI of question streams against the adapter's reference.

    python -m benchmarks.drift_streams [--artifact artifacts/default] [--window 100] [--draws 1000]
        [--output benchmarks/results/drift_streams.json]

Each stream is a window of questions answered by the adapter (the same predictor the service uses); its u
values are compared with the validation reference sample in the manifest exactly as the service's drift
monitor does (ibedl.engine.drift: KS statistic, PSI, alarm threshold = the (1 - alarm rate) quantile of KS between
bootstrap resamples of the reference at the window size). Streams:

  sciq_test_with_passage     SciQ test questions with their support passage (in distribution, unseen)
  sciq_test_no_passage       the same questions without the passage
  sciq_shuffled_options      SciQ test questions with the options of another question (no right answer)
  arc_easy                   ARC-Easy test questions (another dataset, no passage)
  race_no_article            RACE test questions without their article (another domain, passage missing)
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np

from benchmarks.common import write_result
from ibedl.core.predictor import Predictor
from ibedl.engine.drift import bootstrap_threshold, ks_statistic, psi
from ibedl.training.data import load_dataset


def streams(window: int) -> dict[str, list]:
    sciq = load_dataset("sciq", "test", limit=window, seed=1)
    others = sciq[1:] + sciq[:1]
    return {
        "sciq_test_with_passage": sciq,
        "sciq_test_no_passage": [dataclasses.replace(q, context=None) for q in sciq],
        "sciq_shuffled_options": [
            dataclasses.replace(q, options=o.options, answer=None) for q, o in zip(sciq, others, strict=False)
        ],
        "arc_easy": [q for q in load_dataset("arc_easy", "test", limit=2 * window, seed=1)
                     if len(q.options) == 4][:window],
        "race_no_article": [dataclasses.replace(q, context=None)
                            for q in load_dataset("race", "test", limit=window, seed=1)],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", default="artifacts/default")
    parser.add_argument("--window", type=int, default=100)
    parser.add_argument("--alarm-rate", type=float, default=0.01)
    parser.add_argument("--draws", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--output", default="benchmarks/results/drift_streams.json")
    args = parser.parse_args(argv)
    if args.window < 10:
        parser.error(f"--window must be at least 10, got {args.window}")

    predictor = Predictor.from_artifact(args.artifact)
    reference = np.asarray(predictor.manifest.reference["uncertainty"], dtype=np.float64)
    threshold = bootstrap_threshold(reference, args.window, args.alarm_rate, args.draws)
    result = {
        "artifact": args.artifact,
        "window": args.window,
        "reference_size": len(reference),
        "reference_mean_u": float(reference.mean()),
        "ks_threshold": threshold,
        "alarm_rate": args.alarm_rate,
        "streams": {},
    }
    for name, questions in streams(args.window).items():
        preds = []
        for i in range(0, len(questions), args.batch_size):
            preds += predictor.predict(questions[i:i + args.batch_size])
        u = np.asarray([p.uncertainty for p in preds], dtype=np.float64)
        labelled = [(p.index == q.answer) for p, q in zip(preds, questions, strict=True) if q.answer is not None]
        row = {
            "n": len(u),
            "mean_u": float(u.mean()),
            "mean_confidence": float(np.mean([p.confidence for p in preds])),
            "accuracy": float(np.mean(labelled)) if labelled else None,
            "ks": ks_statistic(u, reference),
            "psi": psi(reference, u),
        }
        row["alarm"] = bool(row["ks"] > threshold)
        result["streams"][name] = row
        print(f"{name:24s} n={row['n']:4d} mean u={row['mean_u']:.3f} KS={row['ks']:.3f} PSI={row['psi']:.3f} "
              f"alarm={row['alarm']}", flush=True)
    write_result(args.output, result, echo=False)
    print(json.dumps({k: v for k, v in result.items() if k != "streams"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
