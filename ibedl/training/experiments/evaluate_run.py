"""One benchmark evaluation in its own process: an artifact, a method's predictive, several test sets.

    python -m ibedl.training.experiments.evaluate_run --artifact DIR --method METHOD --dataset D [--dataset D2 ...]
        --output FILE

The method's record says how the artifact predicts: its dropout-on passes (MC-Dropout on a MAP artifact)
and its predictive fit, made on the artifact's training data (Laplace: a KFAC posterior over the LoRA
weights, the ``laplace`` extra). Writes, per dataset, the predictive probabilities, labels, uncertainty
masses and test throughput.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

from ibedl.core.artifact import atomic_write_text, read_manifest
from ibedl.core.cpu_isa import describe_device
from ibedl.training import metrics


def limits_for(limits: dict, dataset: str) -> dict:
    return {**limits.get("default", {}), **limits.get(dataset, {})}


VARIANTS = ("no_context",)


def load_eval_set(spec: str, limit: int | None, seed: int = 0, split: str = "test") -> list:
    """Questions of ``name`` or ``name:no_context`` (the same questions without their passage or article) from
    ``split`` (test by default)."""
    from ibedl.training.data import load_dataset

    name, _, variant = spec.partition(":")
    if variant and variant not in VARIANTS:
        raise ValueError(f"unknown dataset variant {variant!r} in {spec!r}; known: {', '.join(VARIANTS)}")
    questions = load_dataset(name, split, limit=limit, seed=seed)
    return [dataclasses.replace(q, context=None) for q in questions] if variant == "no_context" else questions


# AUROC scores beside max probability (mp): 1/u (um, Dirichlet methods), energy and Mahalanobis
# (ibedl.training.ood_scores)
FEATURE_SCORES = {"energy": "energy", "maha": "mahalanobis"}


def _auroc_pair(first: dict, ood: dict, keep_id, keep_ood) -> dict:
    """AUROC by max probability (mp), by 1/u (um) for Dirichlet methods, and by the energy and Mahalanobis scores
    where the predictions carry them, on the kept questions."""
    def kept(values, keep) -> np.ndarray:
        values, keep = list(values), list(keep)
        if len(values) != len(keep):
            raise ValueError(f"{len(values)} scores for {len(keep)} questions")
        return np.array([v for v, k in zip(values, keep, strict=True) if k], dtype=np.float64)

    out = {"mp": metrics.auroc(kept(map(max, first["probs"]), keep_id), kept(map(max, ood["probs"]), keep_ood))}
    if first["uncertainty"] is not None and ood["uncertainty"] is not None:
        out["um"] = metrics.auroc(-kept(first["uncertainty"], keep_id), -kept(ood["uncertainty"], keep_ood))
    for name, key in FEATURE_SCORES.items():
        if first.get(key) is not None and ood.get(key) is not None:
            out[name] = metrics.auroc(kept(first[key], keep_id), kept(ood[key], keep_ood))
    return out


def summarise_run(preds: dict, eval_sets) -> dict:
    """In-distribution metrics on the first set; OOD AUROC (ID positive) against each other set, on all questions
    and with the option count matched (both sides restricted to the in-distribution set's most common count:
    evidential scores shift with the number of options, so a count mismatch alone can separate the sets)."""
    first = preds["sets"][eval_sets[0]]
    out = metrics.summarise(first["probs"], first["labels"], first["uncertainty"])
    if first.get("sigma") is not None:  # IB-EDL: does sigma differ between questions, and between streams?
        out.update({f"sigma/{k}": v for k, v in sigma_summary(first["sigma"]).items()})
        out["sigma/spearman_inv_u"] = spearman(first["sigma"], 1.0 / np.asarray(first["uncertainty"]))
    counts_id = [len(p) for p in first["probs"]]
    modal = max(set(counts_id), key=counts_id.count)
    for other in eval_sets[1:]:
        ood = preds["sets"][other]
        for score, value in _auroc_pair(first, ood, [True] * len(counts_id), [True] * len(ood["probs"])).items():
            out[f"ood/{other}/auroc_{score}"] = value
        keep_ood = [len(p) == modal for p in ood["probs"]]
        if sum(keep_ood) >= 10:
            matched = _auroc_pair(first, ood, [c == modal for c in counts_id], keep_ood)
            for score, value in matched.items():
                out[f"ood/{other}/auroc_{score}_matched"] = value
            out[f"ood/{other}/matched_options"] = modal
            out[f"ood/{other}/matched_n"] = sum(keep_ood)
        if ood.get("sigma") is not None:  # does sigma tell the streams apart beyond 1/u? (ID positive, sigma as score)
            out[f"ood/{other}/sigma_median"] = sigma_summary(ood["sigma"])["median"]
            out[f"ood/{other}/auroc_sigma"] = metrics.auroc(np.asarray(first["sigma"]), np.asarray(ood["sigma"]))
            out[f"ood/{other}/sigma_spearman_inv_u"] = spearman(ood["sigma"], 1.0 / np.asarray(ood["uncertainty"]))
        ood_metrics = metrics.summarise(ood["probs"], ood["labels"])
        for key in ("accuracy", "ece", "nll"):
            out[f"ood/{other}/{key}"] = ood_metrics[key]
    return out


def outputs(preds) -> dict:
    """Probabilities (rounded to 7 digits), uncertainty masses (None without a Dirichlet) and IB-EDL's sigma averaged
    over each question's options (None for other methods) of predictions."""
    return {"probs": [[round(x, 7) for x in p.probs] for p in preds],
            "uncertainty": None if preds[0].uncertainty is None else [p.uncertainty for p in preds],
            "sigma": None if preds[0].sigma is None else [round(float(np.mean(p.sigma)), 6) for p in preds]}


def spearman(a, b) -> float:
    """Spearman's rank correlation of two per-question series (scipy.stats.spearmanr)."""
    return float(spearmanr(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)).statistic)


def sigma_summary(values) -> dict:
    """Median, interquartile range and coefficient of variation (std / mean) of per-question sigma."""
    v = np.asarray(values, dtype=np.float64)
    q1, median, q3 = np.percentile(v, [25, 50, 75])
    return {"median": float(median), "iqr": float(q3 - q1), "cv": float(v.std() / v.mean()) if v.mean() > 0 else 0.0}


def without_posthoc(preds: dict) -> dict | None:
    """The predictions of a run with its post-hoc step undone (IB-EDL's zeta at 0), or None when it has none."""
    sets = preds["sets"]
    if not all("without_posthoc" in s for s in sets.values()):
        return None
    return {"sets": {name: {**s, **s["without_posthoc"]} for name, s in sets.items()}}


def trained_dtype(training: dict | None):
    """The torch dtype a run trained in, as its config names it (``dtype: float32``), or None (then the device's
    default: fp32 on CPU, bf16 on CUDA). A run evaluates in the dtype it trained in."""
    from ibedl.training.finetune import DTYPES

    name = ((training or {}).get("config") or {}).get("dtype")
    return DTYPES[name] if name else None


def load_run(artifact: str | Path):
    """A trained run's artifact as it trained: in its config's dtype, and, when only its top layers were trained
    (``train_layers``), with the layers below read from the prefix cache. Returns the Predictor."""
    from ibedl.core import prefix_cache
    from ibedl.core.predictor import Predictor

    predictor = Predictor.from_artifact(artifact, dtype=trained_dtype(read_manifest(artifact).training))
    trained = (predictor.manifest.training or {}).get("config") or {}
    if trained.get("train_layers"):
        prefix_cache.attach(predictor, trained["train_layers"], predictor.manifest.base_model["sha256"])
    return predictor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ibedl.training.experiments.evaluate_run",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", required=True)
    parser.add_argument("--method", required=True)
    parser.add_argument("--dataset", action="append", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--limits", default="{}", help="JSON {dataset|default: {test: N, train: N}}")
    parser.add_argument("--method-params", default="{}", help="JSON of the method's hyper-parameters")
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args(argv)

    from ibedl.training.finetune import predictive_fit_questions, run_questions
    from ibedl.training.methods import get_method

    limits = json.loads(args.limits)
    method = get_method(args.method)
    params = method.params(json.loads(args.method_params))
    predictor = load_run(args.artifact)
    if method.num_mc_samples(params):  # the predictive of a method trained as the artifact was (MC-Dropout on MAP)
        predictor.mc_samples = method.num_mc_samples(params)
        predictor.eval()
    # The run's training and validation questions, drawn once: the predictive fit and the Mahalanobis score use them.
    cfg, train_q, val_q = run_questions(predictor.manifest.training) if predictor.manifest.training else (None, [], [])
    fit = None
    if method.predictive_fit is not None:  # on the questions the run trained and was calibrated on, as finetune does
        fit_q = predictive_fit_questions(method, params, train_q, cfg.seed)
        start = time.perf_counter()
        predictor = method.predictive_fit.fit(predictor, fit_q, val_q, params)
        # what the predictive fit chose (Laplace's prior precision) and its cost, data loading left out
        fit = {**(getattr(predictor, "predictive_fit_info", None) or {}), "fit_seconds": time.perf_counter() - start}
    with predictor.reusing_hidden():  # one trunk pass per question serves predictions, features and zeta 0
        out = predict_sets(predictor, args, limits, val_q, fit)
    atomic_write_text(args.output, json.dumps(out))  # the runner takes a present file as finished
    return 0


def predict_sets(predictor, args, limits: dict, val_q: list, fit: dict | None) -> dict:
    """evaluate_run's output for ``args.dataset``: per set, the outputs, labels, throughput, energy and Mahalanobis
    scores, the predictive ``fit`` (under ``posthoc``) and (IB-EDL with zeta) the outputs without zeta."""
    from ibedl.training.evaluate import predict_all
    from ibedl.training.ood_scores import Mahalanobis, features

    # Feature-space OOD score: class-conditional Gaussians on the run's validation (calibration) questions.
    maha = Mahalanobis.fit(features(predictor, val_q, args.batch_size)[1], [q.answer for q in val_q]) if val_q else None
    machine = describe_device(predictor.device)  # where each set's samples_per_s is measured
    out = {"artifact": str(args.artifact), "method": args.method, "sets": {},
           "mahalanobis": None if maha is None else {"n": len(val_q), "shrinkage": maha.shrinkage}}
    for dataset in args.dataset:
        questions = load_eval_set(dataset, limits_for(limits, dataset).get("test"))
        preds, seconds = predict_all(predictor, questions, args.batch_size, progress=False)
        served = outputs(preds)
        out["sets"][dataset] = {**served, "labels": [q.answer for q in questions],
                                "samples_per_s": len(questions) / seconds,
                                "machine": machine}
        energies, hidden = features(predictor, questions, args.batch_size)
        out["sets"][dataset]["energy"] = [round(float(e), 6) for e in energies]
        out["sets"][dataset]["mahalanobis"] = None if maha is None else [round(float(m), 4) for m in maha.score(hidden)]
        if fit is not None:  # with every set: the benchmark caches predictions per set, and a cell's record
            out["sets"][dataset]["posthoc"] = fit  # names the fit behind each of its sets
        out["sets"][dataset].update(zeta_free(predictor, questions, served, args.batch_size))
    return out


def zeta_free(predictor, questions: list, served: dict, batch_size: int) -> dict:
    """IB-EDL's outputs without its post-hoc zeta (``{"without_posthoc": ...}``, the paper's IB-EDL): predicted
    again with zeta at 0, or ``served`` (:func:`outputs` of the predictions as served) where the fit chose 0, so that
    every IB-EDL set has the row. Other heads: {}."""
    from ibedl.training.evaluate import predict_all

    config = getattr(getattr(predictor, "head", None), "config", None)
    if getattr(config, "posthoc_key", None) != "zeta":
        return {}
    if not config.zeta:
        return {"without_posthoc": served}
    fitted, config.zeta = config.zeta, 0.0
    try:
        return {"without_posthoc": outputs(predict_all(predictor, questions, batch_size, progress=False)[0])}
    finally:
        config.zeta = fitted


if __name__ == "__main__":
    sys.exit(main())
