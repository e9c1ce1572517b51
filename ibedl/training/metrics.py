"""Evaluation metrics with fixed definitions (DESIGN.md section 2), on numpy arrays.

Inputs are per-question: ``probs`` as a list of 1-D arrays (questions may have different option counts)
or a (N, C) array, ``labels`` (N,) option indices. :func:`summarise` gives the flat keys that
results files and reports use: ``accuracy``, ``ece`` (15 bins), ``ece_10/15/25/35``, ``nll``, ``brier``,
``aurc``, ``acc@80``, ``acc@90``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

ECE_BINS = (10, 15, 25, 35)
NLL_FLOOR = 1e-12  # guards log(0) for a predictive that puts no mass on the label


def _as_rows(probs) -> list[np.ndarray]:
    if isinstance(probs, np.ndarray) and probs.ndim == 2:
        return list(probs.astype(np.float64))
    return [np.asarray(p, dtype=np.float64) for p in probs]


def _check(probs: list[np.ndarray], labels: np.ndarray) -> None:
    if len(probs) != len(labels):
        raise ValueError(f"{len(probs)} predictions for {len(labels)} labels")
    if len(probs) == 0:
        raise ValueError("metrics need at least one prediction")
    for i, (row, y) in enumerate(zip(probs, labels, strict=True)):
        if not 0 <= y < len(row):  # a negative label would silently index from the end
            raise ValueError(f"label {y} of question {i} is outside its {len(row)} options")


def confidences_and_hits(probs, labels) -> tuple[np.ndarray, np.ndarray]:
    """Top-label confidence (N,) and whether the top label is right (N,) as float."""
    rows = _as_rows(probs)
    labels = np.asarray(labels)
    _check(rows, labels)
    conf = np.array([r.max() for r in rows])
    hits = np.array([float(r.argmax() == y) for r, y in zip(rows, labels, strict=True)])
    return conf, hits


def accuracy(probs, labels) -> float:
    return float(confidences_and_hits(probs, labels)[1].mean())


def ece(probs, labels, num_bins: int = 15) -> float:
    """Top-label L1 expected calibration error over ``num_bins`` equal-width bins of (0, 1].

    Bins are right-closed, (k/n, (k+1)/n], as in torchmetrics' binary-search binning.
    """
    r = reliability(probs, labels, num_bins)
    n = sum(r["count"])
    bins = zip(r["count"], r["confidence"], r["accuracy"], strict=True)
    return float(sum(c / n * abs(cf - ac) for c, cf, ac in bins if c))


def bin_index(conf: np.ndarray, num_bins: int) -> np.ndarray:
    """The ECE bin of each confidence (any shape): equal width, right-closed (k/n, (k+1)/n], 0 in the first."""
    edges = np.linspace(0.0, 1.0, num_bins + 1)
    return np.clip(np.searchsorted(edges, conf, side="left") - 1, 0, num_bins - 1)


def reliability(probs, labels, num_bins: int = 15) -> dict:
    """Per-bin mean confidence, accuracy and count (for reliability diagrams and ECE)."""
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    conf, hits = confidences_and_hits(probs, labels)
    index = bin_index(conf, num_bins)
    out = {"edges": np.linspace(0.0, 1.0, num_bins + 1).tolist(), "confidence": [], "accuracy": [], "count": []}
    for b in range(num_bins):
        in_bin = index == b
        out["count"].append(int(in_bin.sum()))
        out["confidence"].append(float(conf[in_bin].mean()) if in_bin.any() else None)
        out["accuracy"].append(float(hits[in_bin].mean()) if in_bin.any() else None)
    return out


def nll_terms(probs, labels) -> np.ndarray:
    """-log p_y of each question (N,), p_y floored at 1e-12."""
    rows = _as_rows(probs)
    labels = np.asarray(labels)
    _check(rows, labels)
    return np.array([-math.log(max(r[y], NLL_FLOOR)) for r, y in zip(rows, labels, strict=True)])


def nll(probs, labels) -> float:
    """Mean -log p_y of the predictive probabilities (floored at 1e-12)."""
    return float(nll_terms(probs, labels).mean())


def brier_terms(probs, labels) -> np.ndarray:
    """sum_j (p_j - y_j)^2 of each question (N,)."""
    rows = _as_rows(probs)
    labels = np.asarray(labels)
    _check(rows, labels)
    out = np.empty(len(rows))
    for i, (r, y) in enumerate(zip(rows, labels, strict=True)):
        target = np.zeros_like(r)
        target[y] = 1.0
        out[i] = ((r - target) ** 2).sum()
    return out


def brier(probs, labels) -> float:
    """Mean over questions of sum_j (p_j - y_j)^2."""
    return float(brier_terms(probs, labels).mean())


def auroc(scores_pos: Sequence[float], scores_neg: Sequence[float]) -> float:
    """Area under the ROC curve for scores where the positive class should score higher.

    Mann-Whitney form with ties counted one half; equals sklearn's roc_auc_score.
    """
    pos = np.asarray(scores_pos, dtype=np.float64)
    neg = np.asarray(scores_neg, dtype=np.float64)
    if len(pos) == 0 or len(neg) == 0:
        raise ValueError(f"AUROC needs both classes, got {len(pos)} positive and {len(neg)} negative")
    scores = np.concatenate([pos, neg])
    order = scores.argsort(kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    # average ranks over ties
    i = 0
    while i < len(scores):
        j = i
        while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    rank_sum = ranks[: len(pos)].sum()
    return float((rank_sum - len(pos) * (len(pos) + 1) / 2.0) / (len(pos) * len(neg)))


def risk_coverage(scores: Sequence[float], hits: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """Selective risk at each coverage k/N, answering the k highest-scoring questions first.

    Returns (coverage (N,), risk (N,)). Ties keep input order (stable sort).
    """
    scores = np.asarray(scores, dtype=np.float64)
    hits = np.asarray(hits, dtype=np.float64)
    if len(scores) != len(hits) or len(scores) == 0:
        raise ValueError(f"need equal, non-zero lengths, got {len(scores)} scores and {len(hits)} hits")
    order = np.argsort(-scores, kind="mergesort")
    errors = 1.0 - hits[order]
    k = np.arange(1, len(scores) + 1)
    return k / len(scores), np.cumsum(errors) / k


def aurc(scores, hits) -> float:
    """Area under the risk-coverage curve: mean selective risk over coverages 1/N..1."""
    return float(risk_coverage(scores, hits)[1].mean())


def accuracy_at_coverage(scores, hits, coverage: float) -> float:
    """Accuracy on the ceil(coverage * N) highest-scoring questions."""
    if not 0 < coverage <= 1:
        raise ValueError(f"coverage must be in (0, 1], got {coverage}")
    cov, risk = risk_coverage(scores, hits)
    k = max(1, math.ceil(coverage * len(cov) - 1e-9))
    return float(1.0 - risk[k - 1])


def summarise(probs, labels, uncertainty: Sequence[float] | None = None) -> dict:
    """All in-distribution metrics of one evaluation as a flat dict of floats.

    Selective prediction uses max probability as the score, and 1/u too when ``uncertainty`` is given.
    """
    conf, hits = confidences_and_hits(probs, labels)
    out = {
        "n": len(hits),
        "accuracy": float(hits.mean()),
        "ece": ece(probs, labels, 15),
        "nll": nll(probs, labels),
        "brier": brier(probs, labels),
        "aurc": aurc(conf, hits),
        "acc@80": accuracy_at_coverage(conf, hits, 0.8),
        "acc@90": accuracy_at_coverage(conf, hits, 0.9),
        "mean_confidence": float(conf.mean()),
    }
    for bins in ECE_BINS:
        out[f"ece_{bins}"] = ece(probs, labels, bins)
    if uncertainty is not None:
        u = np.asarray(uncertainty, dtype=np.float64)
        out["aurc_um"] = aurc(-u, hits)
        out["mean_uncertainty"] = float(u.mean())
    return out
