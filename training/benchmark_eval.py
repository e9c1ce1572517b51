"""One benchmark evaluation in its own process: an artifact, a method's predictive, several test sets.

    python -m training.benchmark_eval --artifact DIR --method METHOD --dataset D [--dataset D2 ...] --output FILE

``mc_dropout`` evaluates a MAP artifact with T dropout-on passes; ``laplace`` fits a KFAC Laplace
posterior over the MAP adapter's LoRA weights (laplace-torch, the ``laplace`` extra) and predicts with
the GLM probit approximation. Other methods use the artifact as trained. Writes, per dataset, the
predictive probabilities, labels, uncertainty masses and test throughput.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from evidential.artifact import atomic_write_text
from training import metrics


def limits_for(limits: dict, dataset: str) -> dict:
    return {**limits.get("default", {}), **limits.get(dataset, {})}


def summarise_run(preds: dict, eval_sets) -> dict:
    """In-distribution metrics on the first set; OOD AUROC (ID positive) against each other set."""
    first = preds["sets"][eval_sets[0]]
    out = metrics.summarise(first["probs"], first["labels"], first["uncertainty"])
    conf_id = np.array([max(p) for p in first["probs"]])
    for other in eval_sets[1:]:
        ood = preds["sets"][other]
        conf_ood = np.array([max(p) for p in ood["probs"]])
        out[f"ood/{other}/auroc_mp"] = metrics.auroc(conf_id, conf_ood)
        if first["uncertainty"] is not None and ood["uncertainty"] is not None:
            out[f"ood/{other}/auroc_um"] = metrics.auroc(-np.array(first["uncertainty"]), -np.array(ood["uncertainty"]))
        ood_metrics = metrics.summarise(ood["probs"], ood["labels"])
        for key in ("accuracy", "ece", "nll"):
            out[f"ood/{other}/{key}"] = ood_metrics[key]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.benchmark_eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", required=True)
    parser.add_argument("--method", required=True)
    parser.add_argument("--dataset", action="append", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limits", default="{}", help="JSON {dataset|default: {test: N, train: N}}")
    parser.add_argument("--method-params", default="{}", help="JSON of the method's hyper-parameters")
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args(argv)

    from evidential.predictor import Predictor
    from training.data import load_dataset
    from training.evaluate import predict_all

    limits = json.loads(args.limits)
    params = json.loads(args.method_params)
    predictor = Predictor.from_artifact(args.artifact)
    if args.method == "mc_dropout":
        predictor.mc_samples = int(params.get("mc_samples", 10))
        predictor.eval()
    laplace = None
    if args.method == "laplace":
        from training.laplace_lora import fit_laplace

        manifest = predictor.manifest
        train_set = manifest.training["data"]["train"][0]
        n_fit = int(params.get("fit_samples", 200))
        fit_q = load_dataset(train_set["dataset"], "train", limit=n_fit, seed=args.seed,
                             label_noise=manifest.training.get("label_noise", 0.0), noise_seed=args.seed)
        laplace = fit_laplace(predictor, fit_q, prior_precision=params.get("prior_precision"),
                              batch_size=int(params.get("batch_size", 4)))
    out = {"artifact": str(args.artifact), "method": args.method, "sets": {}}
    for dataset in args.dataset:
        questions = load_dataset(dataset, "test", limit=limits_for(limits, dataset).get("test"), seed=0)
        if laplace is not None:
            probs, seconds = laplace.predict(questions, batch_size=args.batch_size)
            uncertainty = None
        else:
            preds, seconds = predict_all(predictor, questions, args.batch_size, progress=False)
            probs = [p.probs for p in preds]
            uncertainty = None if preds[0].uncertainty is None else [p.uncertainty for p in preds]
        out["sets"][dataset] = {
            "probs": [[round(x, 7) for x in p] for p in probs],
            "labels": [q.answer for q in questions],
            "uncertainty": uncertainty,
            "samples_per_s": len(questions) / seconds,
        }
    atomic_write_text(args.output, json.dumps(out))  # the runner takes a present file as finished
    return 0


if __name__ == "__main__":
    sys.exit(main())
