"""The abstention rule, in order: out of distribution (the OOD score below the gate's threshold), u above
max_uncertainty, max p below min_confidence."""

from __future__ import annotations

from dataclasses import replace

from ibedl.core.artifact import Abstention


def effective(defaults: Abstention, max_uncertainty: float | None, min_confidence: float | None) -> Abstention:
    """A request's thresholds: it may tighten the adapter's defaults, never loosen them."""
    if max_uncertainty is None and min_confidence is None:
        return defaults
    u = defaults.max_uncertainty if max_uncertainty is None else min(defaults.max_uncertainty, max_uncertainty)
    p = defaults.min_confidence if min_confidence is None else max(defaults.min_confidence, min_confidence)
    return replace(defaults, max_uncertainty=u, min_confidence=p)


def ood_score(uncertainty: float | None, confidence: float, kind: str | None = None) -> float:
    """Higher is more in-distribution: 1/u with a Dirichlet, max p without or when ``kind`` is
    ``max_probability`` (ibedl.training.calibrate stores the kind it calibrated)."""
    if uncertainty is None or kind == "max_probability":
        return confidence
    return 1.0 / uncertainty


def decide(uncertainty: float | None, confidence: float, thresholds: Abstention) -> str | None:
    """The reason to abstain, or None to answer.

    Without a Dirichlet (``uncertainty`` None) the gate compares max p and the u threshold does not apply.
    """
    if (thresholds.ood_threshold > 0
            and ood_score(uncertainty, confidence, thresholds.ood_score) < thresholds.ood_threshold):
        return "out_of_distribution"
    if uncertainty is not None and uncertainty > thresholds.max_uncertainty:
        return "max_uncertainty"
    if confidence < thresholds.min_confidence:
        return "min_confidence"
    return None
