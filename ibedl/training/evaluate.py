"""Evaluate an adapter on a dataset split: accuracy, ECE (10/15/25/35 bins), NLL, Brier, AURC, and a
reliability diagram.

    python -m ibedl.training.evaluate --artifact artifacts/default --dataset sciq --split test \
        [--limit N] [--output results.json] [--batch-size 8] [--backend torch]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ibedl.core.paths import check_writable
from ibedl.core.predictor import Prediction, Predictor
from ibedl.core.prompt import MCQuestion
from ibedl.training import metrics


@dataclass
class EvalResult:
    """Predictions of one evaluation, in question order, and their metrics."""

    predictions: list[Prediction]
    labels: list[int]
    metrics: dict = field(default_factory=dict)

    @property
    def probs(self) -> list[list[float]]:
        return [p.probs for p in self.predictions]

    @property
    def uncertainty(self) -> list[float] | None:
        if any(p.uncertainty is None for p in self.predictions):
            return None
        return [p.uncertainty for p in self.predictions]

    @property
    def confidence(self) -> list[float]:
        return [p.confidence for p in self.predictions]

    @property
    def hits(self) -> list[float]:
        return [float(p.index == y) for p, y in zip(self.predictions, self.labels, strict=True)]


def chunks(questions: list[MCQuestion], batch_size: int) -> list[list[int]]:
    """Indices of ``questions`` in the chunks of ``batch_size`` that evaluation hands the predictor, shortest
    (in characters) first. :func:`predict_all` and the OOD features (``ibedl.training.ood_scores.features``) read
    the same chunks, so under ``Predictor.reusing_hidden`` the second reuses the first's trunk passes."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    lengths = [len(q.question) + len(q.context or "") + sum(len(o) for o in q.options) for q in questions]
    order = sorted(range(len(questions)), key=lengths.__getitem__)
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def some_questions(questions: list[MCQuestion], dataset: str, split: str, path: str | None) -> list[MCQuestion]:
    """``questions`` when there is at least one; else ValueError naming where they were read (the file for a JSONL
    ``path``, else the dataset's split), before a model loads for nothing."""
    if not questions:
        where = path if dataset == "jsonl" and path else f"{dataset}/{split}"
        raise ValueError(f"{where} holds no questions")
    return questions


def check_arguments(args: argparse.Namespace) -> tuple[Path, Path] | None:
    """ValueError naming the first argument of ``args`` that cannot work, before any data or model is read; the
    metrics JSON's and the reliability diagram's paths (None without ``--output``)."""
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if not args.output:
        return None
    out = Path(args.output)
    png = out.with_suffix(".png")
    if out.suffix.lower() == png.suffix:  # the diagram would overwrite the metrics
        raise ValueError(f"--output {out} is where the reliability diagram goes (the metrics file's name with .png): "
                         f"name the metrics file otherwise, e.g. {out.with_suffix('.json')}")
    return check_writable(out, "--output"), check_writable(png, f"--output {out}: its reliability diagram")


def predict_all(
    predictor: Predictor, questions: list[MCQuestion], batch_size: int = 8, progress: bool = True, desc: str = "eval"
) -> tuple[list[Prediction], float]:
    """Predictions for every question, in input order; batches are formed by prompt length (:func:`chunks`)."""
    start = time.perf_counter()
    out: list[Prediction | None] = [None] * len(questions)
    was_training = predictor.model is not None and predictor.model.training  # None: released for a backend trunk
    predictor.eval()
    with torch.no_grad(), tqdm(total=len(questions), desc=desc, disable=not progress, unit="q", leave=False) as bar:
        for idx in chunks(questions, batch_size):
            for j, pred in zip(idx, predictor.predict([questions[k] for k in idx]), strict=True):
                out[j] = pred
            bar.update(len(idx))
    if was_training:
        predictor.model.train()
    return out, time.perf_counter() - start  # type: ignore[return-value]


def evaluate(predictor: Predictor, questions: list[MCQuestion], batch_size: int = 8, progress: bool = True,
             desc: str = "eval", accelerator=None) -> EvalResult:
    """Predict ``questions`` (all must carry an answer) and compute the metrics.

    With an ``accelerate.Accelerator`` of several processes (training under accelerate launch), each process
    predicts its contiguous share and ``gather_for_metrics`` puts them back in question order on every process.
    """
    missing = [i for i, q in enumerate(questions) if q.answer is None]
    if missing:
        raise ValueError(f"questions {missing[:5]} have no answer to evaluate against")
    if accelerator is not None and accelerator.num_processes > 1:
        with accelerator.split_between_processes(questions) as share:
            preds, seconds = predict_all(predictor, share, batch_size, progress and accelerator.is_main_process, desc)
        preds = accelerator.gather_for_metrics(preds, use_gather_object=True)
    else:
        preds, seconds = predict_all(predictor, questions, batch_size, progress, desc)
    result = EvalResult(preds, [q.answer for q in questions])
    result.metrics = metrics.summarise(result.probs, result.labels, result.uncertainty)
    result.metrics["samples_per_s"] = len(questions) / seconds if seconds > 0 else float("inf")
    return result


def main(argv: list[str] | None = None) -> int:
    from ibedl.core.artifact import ArtifactError
    from ibedl.core.backends.registry import BACKENDS
    from ibedl.training.data import DATASETS, load_dataset
    from ibedl.training.data.errors import DatasetError
    from ibedl.training.plots import reliability_diagram

    parser = argparse.ArgumentParser(prog="python -m ibedl.training.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", required=True, help="adapter directory (with manifest.json)")
    parser.add_argument("--dataset", required=True, help=f"one of {sorted(DATASETS)}")
    parser.add_argument("--split", default="test", help="train, validation or test (default test)")
    parser.add_argument("--path", help="file for --dataset jsonl")
    parser.add_argument("--limit", type=int, help="evaluate a seeded random subset of this size")
    parser.add_argument("--seed", type=int, default=0, help="seed of the --limit subset")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--base-model", help="override the manifest's base model reference")
    parser.add_argument("--backend", default=None,
                        help=f"inference backend: {', '.join(BACKENDS)} (default IBEDL_BACKEND or auto: what the "
                             "service would serve, the fastest calibrated backend on this machine, timed at start-up)")
    parser.add_argument("--output", help="write metrics JSON here, e.g. m.json (and the reliability diagram beside "
                        "it: m.png)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        written = check_arguments(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.backend is None:  # the service's setting, read as the service reads it
        from pydantic import ValidationError

        from ibedl.engine.settings import EngineSettings

        try:
            args.backend = EngineSettings().backend
        except ValidationError as e:
            parser.error(f"the IBEDL_* settings are not valid: {e}")
    handler = logging.StreamHandler()  # the backend choice and a one-off export show on stderr
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    logging.getLogger("ibedl.core.backends").addHandler(handler)
    logging.getLogger("ibedl.core.backends").setLevel(logging.INFO)
    try:
        questions = some_questions(load_dataset(args.dataset, args.split, path=args.path, limit=args.limit,
                                                seed=args.seed), args.dataset, args.split, args.path)
        predictor = Predictor.from_artifact(args.artifact, base_model=args.base_model, backend=args.backend)
    except (DatasetError, ArtifactError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = evaluate(predictor, questions, args.batch_size, progress=not args.no_progress)
    report = {
        "artifact": str(args.artifact),
        "method": predictor.manifest.method if predictor.manifest else None,
        "dataset": args.dataset,
        "split": args.split,
        "limit": args.limit,
        "backend": predictor.backend,
        "calibration": None if predictor.calibration is None else predictor.calibration.key,
        **result.metrics,
    }
    print(json.dumps(report, indent=2))
    if written:
        out, png = written
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=2) + "\n")
            reliability_diagram(
                result.probs, result.labels, png, title=f"{report['method']} on {args.dataset}/{args.split}"
            )
        except OSError as e:  # checked on arrival; only a change since then lands here
            print(f"error: cannot write {e.filename}: {e.strerror} (the metrics are printed above)", file=sys.stderr)
            return 2
        print(f"wrote {out} and {png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["EvalResult", "evaluate", "predict_all", "some_questions"]
