"""Default abstention thresholds, chosen on validation data for a target accuracy on answered questions.

The rule served is: abstain when u > max_uncertainty or max p < min_confidence. Candidates are the
pairs of (u quantile, confidence quantile) on the validation split; the chosen pair answers the most
questions among those whose answered accuracy reaches the target (with at least ``min_answered``
answered). When no pair reaches the target, the pair with the highest answered accuracy is kept and the
record says so.
"""

from __future__ import annotations

import numpy as np

QUANTILES = np.linspace(0.0, 1.0, 41)


def choose_thresholds(
    confidence, hits, uncertainty=None, target_accuracy: float = 0.8, min_answered: int = 20
) -> dict:
    """Returns ``{"max_uncertainty", "min_confidence", "how": {...}}`` for the artifact manifest."""
    if not 0 < target_accuracy <= 1:
        raise ValueError(f"target_accuracy must be in (0, 1], got {target_accuracy}")
    conf = np.asarray(confidence, dtype=np.float64)
    hits = np.asarray(hits, dtype=np.float64)
    if len(conf) != len(hits) or len(conf) == 0:
        raise ValueError(f"need equal, non-zero lengths, got {len(conf)} confidences and {len(hits)} hits")
    min_answered = min(min_answered, len(conf))
    conf_cuts = np.unique(np.concatenate([[0.0], np.quantile(conf, QUANTILES)]))
    if uncertainty is None:
        u = np.zeros_like(conf)
        u_cuts = np.array([1.0])
    else:
        u = np.asarray(uncertainty, dtype=np.float64)
        u_cuts = np.unique(np.concatenate([[1.0], np.quantile(u, QUANTILES)]))
    best = None  # (reached, coverage, accuracy, u_max, p_min)
    for u_max in u_cuts:
        for p_min in conf_cuts:
            answered = (u <= u_max) & (conf >= p_min)
            count = int(answered.sum())
            if count < min_answered:
                continue
            acc = float(hits[answered].mean())
            reached = acc >= target_accuracy
            key = (reached, count if reached else acc, acc if reached else count)
            if best is None or key > best[0]:
                best = (key, count / len(conf), acc, float(u_max), float(p_min))
    assert best is not None  # the (1.0, 0.0) pair answers everything
    (reached, *_), coverage, acc, u_max, p_min = best
    return {
        "max_uncertainty": u_max,
        "min_confidence": p_min,
        "how": {
            "split": "validation",
            "rule": "abstain when u > max_uncertainty or max p < min_confidence",
            "target_accuracy": target_accuracy,
            "target_reached": bool(reached),
            "answered_accuracy": acc,
            "coverage": coverage,
            "n": len(conf),
            "uses_uncertainty_mass": uncertainty is not None,
        },
    }
