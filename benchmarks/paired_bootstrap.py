"""Are two adapters' calibration numbers on a test set different beyond resampling noise?

    python -m benchmarks.paired_bootstrap --reference runs/map-warm-1000x3 --artifacts artifacts/default \
        [--dataset sciq] [--split test] [--limit N] [--sample-seed 0] [--unseen-by DIR ...] [--resamples 2000] \
        [--seed 0] [--output benchmarks/results/paired_bootstrap.json]

Each adapter answers the same questions once. Then the questions are resampled with replacement, the same
resample for every adapter, and each metric's difference (adapter minus reference) is recomputed on every
resample. The result gives, per metric, the difference on the full set, its 2.5% and 97.5% percentiles, and
the share of resamples in which the adapter is better (lower ECE, NLL and Brier; higher accuracy). A 95%
interval that excludes 0 is a difference the test set supports; one that straddles 0 is noise at this size.

``--unseen-by`` judges adapters on questions no recipe drew: the split's questions that none of the listed artifacts
(nor the starts they were trained from, followed through ``init_from``) drew for training, e.g. fresh SciQ training
questions (``--split train``) as a second test set beside the test split. ``--sample-seed`` draws another ``--limit``
of them. Each adapter answers as its manifest says (its post-hoc zeta or temperature applied) on the torch backend.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.common import write_result
from ibedl.training import metrics

METRICS = ("accuracy", "ece", "nll", "brier")
HIGHER_IS_BETTER = {"accuracy"}


@dataclass(frozen=True)
class PerQuestion:
    """What each metric averages, per question: confidence, hit, -log p_y, Brier term; each (N,)."""

    confidence: np.ndarray
    hit: np.ndarray
    nll: np.ndarray
    brier: np.ndarray

    @classmethod
    def from_probs(cls, probs, labels) -> PerQuestion:
        """``probs``: N rows of C probabilities (C may vary per row); ``labels``: (N,) option indices.

        A label outside its row's options raises ValueError (``ibedl.training.metrics`` checks it).
        """
        if len(probs) != len(labels) or len(labels) == 0:
            raise ValueError(f"need one probability row per label and at least one, got {len(probs)} rows and "
                             f"{len(labels)} labels")
        conf, hit = metrics.confidences_and_hits(probs, labels)
        return cls(conf, hit, metrics.nll_terms(probs, labels), metrics.brier_terms(probs, labels))

    def metrics(self, index: np.ndarray, num_bins: int = 15) -> dict[str, np.ndarray]:
        """Each metric on each resample. ``index``: (R, N) question indices -> {metric: (R,)}.

        ECE bins are ``ibedl.training.metrics.bin_index``, as in ``ibedl.training.metrics.ece``.
        """
        conf, hit = self.confidence[index], self.hit[index]
        bins = metrics.bin_index(conf, num_bins)
        rows = np.arange(index.shape[0])[:, None]
        gap = np.zeros((index.shape[0], num_bins))
        np.add.at(gap, (np.broadcast_to(rows, bins.shape), bins), conf - hit)  # sum of (conf - hit) per bin
        return {
            "accuracy": hit.mean(1),
            "ece": np.abs(gap).sum(1) / index.shape[1],
            "nll": self.nll[index].mean(1),
            "brier": self.brier[index].mean(1),
        }


def paired_bootstrap(reference: PerQuestion, other: PerQuestion, resamples: int = 2000, seed: int = 0) -> dict:
    """Differences ``other - reference`` per metric on the full set and over paired resamples."""
    n = len(reference.hit)
    if len(other.hit) != n:
        raise ValueError(f"the two adapters answered different numbers of questions: {n} and {len(other.hit)}")
    if resamples < 100:
        raise ValueError(f"resamples must be at least 100, got {resamples}")
    full = np.arange(n)[None, :]
    index = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    ref_full, oth_full = reference.metrics(full), other.metrics(full)
    ref_boot, oth_boot = reference.metrics(index), other.metrics(index)
    out = {}
    for m in METRICS:
        diff = oth_boot[m] - ref_boot[m]
        better = diff > 0 if m in HIGHER_IS_BETTER else diff < 0
        out[m] = {
            "reference": float(ref_full[m][0]),
            "other": float(oth_full[m][0]),
            "difference": float(oth_full[m][0] - ref_full[m][0]),
            "ci95": [float(np.percentile(diff, 2.5)), float(np.percentile(diff, 97.5))],
            "share_better": float(better.mean()),
        }
    return out


def drawn_by(artifacts: list[str | Path]) -> frozenset[str]:
    """The ids of every training question the artifacts drew, and the starts they were trained from (their training
    config's ``init_from``, followed to the first run without one)."""
    from ibedl.training.finetune import start_training_ids

    ids, seen, todo = set(), set(), [Path(a) for a in artifacts]
    while todo:
        path = todo.pop()
        if path.resolve() in seen:
            continue
        seen.add(path.resolve())
        try:
            ids |= start_training_ids(path)
            start = json.loads((path / "manifest.json").read_text())["training"]["config"].get("init_from")
        except (OSError, KeyError, ValueError) as e:
            raise ValueError(f"{path}: its training questions are unknown ({e})") from e
        if start:
            todo.append(Path(start))
    return frozenset(ids)


SERVED_SECTIONS = ("head", "prompt", "base_model", "option_token_ids", "method_config", "mc_samples", "calibrated_on",
                   "backend_calibrations")  # the manifest sections that shape an answer


def adapter_identity(path: str | Path, calibration_key: str) -> dict:
    """What an adapter's answers, computed on backend and precision ``calibration_key`` (``Predictor.calibration_key``:
    ``torch-fp32``, ...), depend on: its weights' sha256 (``calibrate.weights_sha256``), the sha256 of the manifest
    sections that shape an answer (``SERVED_SECTIONS``), its version, and the post-hoc parameter the calibration
    made on that key sets (``posthoc``: zeta or temperature; a reader's copy, also in the hashed sections).

    Raises:
        ValueError: the manifest carries no calibration made on ``calibration_key``.
    """
    from ibedl.core.artifact import read_manifest
    from ibedl.training.calibrate import weights_sha256

    manifest = read_manifest(path)
    calibration = manifest.calibration_for(calibration_key)
    if calibration is None:
        raise ValueError(f"{path} carries no calibration made on {calibration_key!r}")
    sections = json.dumps({k: getattr(manifest, k) for k in SERVED_SECTIONS}, sort_keys=True, default=str)
    return {"weights_sha256": weights_sha256(Path(path), manifest),
            "served_sha256": hashlib.sha256(sections.encode()).hexdigest(), "version": manifest.version,
            "calibration_key": calibration_key, "posthoc": dict(calibration.head)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.paired_bootstrap", description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", required=True, help="adapter directory the others are compared with")
    parser.add_argument("--artifacts", nargs="+", required=True, help="adapter directories to compare")
    parser.add_argument("--dataset", default="sciq", help="the questions: a built-in dataset, or jsonl with --path "
                        "(default sciq)")
    parser.add_argument("--split", default="test", help="its split (default test)")
    parser.add_argument("--path", help="the JSONL file for --dataset jsonl (your own test questions)")
    parser.add_argument("--limit", type=int, help="a seeded random subset of this size (default: the whole split)")
    parser.add_argument("--sample-seed", type=int, default=0, help="seed of that subset (default 0)")
    parser.add_argument("--unseen-by", nargs="+", default=[], metavar="DIR",
                        help="only questions none of these artifacts (nor their starts) drew for training")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--resamples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0, help="seed of the resamples")
    parser.add_argument("--output", default="benchmarks/results/paired_bootstrap.json")
    parser.add_argument("--save-answers", metavar="FILE",
                        help="also write each adapter's answers (ids, labels, probabilities, alpha, sigma, u) as JSON, "
                             "with what they were made on (adapters: weights, served sections, calibration)")
    args = parser.parse_args(argv)
    if args.resamples < 100:
        parser.error(f"--resamples must be at least 100, got {args.resamples}")
    for path in [args.reference, *args.artifacts, *args.unseen_by]:
        if not (Path(path) / "manifest.json").is_file():
            parser.error(f"{path} is not an adapter directory (no manifest.json)")

    from ibedl.core.predictor import Predictor
    from ibedl.training.data import load_dataset
    from ibedl.training.data.errors import DatasetError
    from ibedl.training.evaluate import predict_all

    try:
        excluded = drawn_by(args.unseen_by)
    except ValueError as e:
        parser.error(f"--unseen-by: {e}")
    try:
        questions = load_dataset(args.dataset, args.split, path=args.path, limit=args.limit, seed=args.sample_seed,
                                 exclude=excluded)
    except (DatasetError, ValueError) as e:
        parser.error(str(e))
    labels = [q.answer for q in questions]

    answers, identities = {}, {}

    def answer(path: str) -> PerQuestion:
        predictor = Predictor.from_artifact(path)
        predictions, _ = predict_all(predictor, questions, args.batch_size, desc=Path(path).name)
        answers[path] = {field: [getattr(p, field) for p in predictions]
                         for field in ("probs", "alpha", "sigma", "uncertainty")}
        identities[path] = adapter_identity(path, predictor.calibration_key)  # the calibration it answered under
        return PerQuestion.from_probs([p.probs for p in predictions], labels)

    reference = answer(args.reference)
    comparisons = {path: paired_bootstrap(reference, answer(path), args.resamples, args.seed)
                   for path in args.artifacts}
    write_result(args.output, {
        "reference": args.reference, "dataset": args.dataset, "split": args.split,
        **({"path": args.path} if args.path else {}), "n": len(questions),
        "sample_seed": args.sample_seed, "unseen_by": args.unseen_by, "excluded_drawn": len(excluded),
        "questions_sha256": hashlib.sha256("\n".join(sorted(q.id for q in questions)).encode()).hexdigest(),
        "resamples": args.resamples, "seed": args.seed, "ece_bins": 15,
        "differences": "other minus reference; ci95 is the 2.5-97.5 percentile range over paired resamples",
        "comparisons": comparisons,
    })
    if args.save_answers:
        write_result(args.save_answers, {"ids": [q.id for q in questions], "labels": labels,
                                         "adapters": identities,
                                         "answers": answers}, echo=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
