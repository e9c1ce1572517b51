"""One benchmark evaluation in its own process: an artifact, a method's predictive, several test sets.

    python -m training.experiments.evaluate_run --artifact DIR --method METHOD --dataset D [--dataset D2 ...] --output FILE

The method's record says how the artifact predicts: its dropout-on passes (MC-Dropout on a MAP artifact)
and its post-hoc step, fitted on the artifact's training data (Laplace: a KFAC posterior over the LoRA
weights, the ``laplace`` extra). Writes, per dataset, the predictive probabilities, labels, uncertainty
masses and test throughput.
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
    parser = argparse.ArgumentParser(prog="python -m training.experiments.evaluate_run", description=__doc__.split("\n\n")[0])
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
    from training.methods import get_method

    limits = json.loads(args.limits)
    method = get_method(args.method)
    params = method.params(json.loads(args.method_params))
    predictor = Predictor.from_artifact(args.artifact)
    if method.num_mc_samples(params):  # the predictive of a method trained as the artifact was (MC-Dropout on MAP)
        predictor.mc_samples = method.num_mc_samples(params)
        predictor.eval()
    if method.posthoc is not None:
        manifest = predictor.manifest
        train_set = manifest.training["data"]["train"][0]
        fit_q = load_dataset(train_set["dataset"], "train", limit=method.posthoc.num_samples(params), seed=args.seed,
                             label_noise=manifest.training.get("label_noise", 0.0), noise_seed=args.seed)
        predictor = method.posthoc.fit(predictor, fit_q, params)
    out = {"artifact": str(args.artifact), "method": args.method, "sets": {}}
    for dataset in args.dataset:
        questions = load_dataset(dataset, "test", limit=limits_for(limits, dataset).get("test"), seed=0)
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
