"""The abstention rule: abstain when u > max_uncertainty or max p < min_confidence."""

from __future__ import annotations

from dataclasses import replace

from evidential.artifact import Abstention


def effective(defaults: Abstention, max_uncertainty: float | None, min_confidence: float | None) -> Abstention:
    """A request's thresholds: it may tighten the adapter's defaults, never loosen them."""
    if max_uncertainty is None and min_confidence is None:
        return defaults
    u = defaults.max_uncertainty if max_uncertainty is None else min(defaults.max_uncertainty, max_uncertainty)
    p = defaults.min_confidence if min_confidence is None else max(defaults.min_confidence, min_confidence)
    return replace(defaults, max_uncertainty=u, min_confidence=p)


def decide(uncertainty: float | None, confidence: float, thresholds: Abstention) -> str | None:
    """The reason to abstain (the threshold crossed), or None to answer.

    Without a Dirichlet (``uncertainty`` None) only the confidence threshold applies.
    """
    if uncertainty is not None and uncertainty > thresholds.max_uncertainty:
        return "max_uncertainty"
    if confidence < thresholds.min_confidence:
        return "min_confidence"
    return None
