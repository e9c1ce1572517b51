"""Split-conformal prediction sets over a question's options, with marginal coverage 1 - alpha.

Two non-conformity scores of a question's predictive probabilities p (C,) and an option y:

- ``lac`` (least ambiguous set-valued classifier, Sadinle et al. 2019): s = 1 - p_y. Smallest sets on average.
- ``aps`` (adaptive prediction sets, Romano et al. 2020): s = the total probability of the options ranked
  above y plus half of p_y. Sets grow with the question's ambiguity. APS randomises the share of p_y by
  U ~ Uniform(0, 1); its mean U = 1/2 keeps answers deterministic, and the guarantee holds for any fixed score.
  (The variant that adds all of p_y over-covers: 0.946 for a nominal 0.90 on the SciQ validation calibration part.)

Calibration takes the scores of the true answers of n labelled questions and keeps their
ceil((n + 1)(1 - alpha)) / n empirical quantile q; the set of a new question is every option whose score is
at most q. If the calibration and served questions are exchangeable, the set holds the right answer with
probability at least 1 - alpha (Vovk et al. 2005; Angelopoulos & Bates 2021). Sets never come out empty:
an empty LAC set takes the top option, which can only raise coverage.

Scores are computed per question, so questions with 2..26 options mix freely in one calibration.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, get_args

import numpy as np

ConformalScore = Literal["lac", "aps"]
SCORES = get_args(ConformalScore)


def _check_score(score: str) -> str:
    if score not in SCORES:
        raise ValueError(f"conformal score must be one of {SCORES}, got {score!r}")
    return score


def _check_alpha(alpha: float) -> float:
    if isinstance(alpha, bool) or not 0.0 < float(alpha) < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    return float(alpha)


def option_scores(probs: Sequence[float], score: str) -> np.ndarray:
    """Non-conformity score of every option of one question.

    Args:
        probs: (C,) predictive probabilities.
        score: ``lac`` or ``aps``.

    Returns:
        (C,) scores; lower means the option conforms better.
    """
    _check_score(score)
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 1 or len(p) < 2:
        raise ValueError(f"probs must be one question's (C,) probabilities with C >= 2, got shape {p.shape}")
    if score == "lac":
        return 1.0 - p
    order = np.argsort(-p, kind="stable")  # ties keep option order
    ranked = p[order]
    scores = np.empty_like(p)
    scores[order] = np.cumsum(ranked) - 0.5 * ranked
    return scores


def label_scores(probs: Sequence[Sequence[float]], labels: Sequence[int], score: str) -> np.ndarray:
    """(N,) score of each question's true answer; questions may have different option counts."""
    if len(probs) != len(labels):
        raise ValueError(f"{len(probs)} probability rows for {len(labels)} labels")
    out = np.empty(len(labels), dtype=np.float64)
    for i, (p, y) in enumerate(zip(probs, labels)):
        if not 0 <= int(y) < len(p):
            raise ValueError(f"label {y} of question {i} is outside its {len(p)} options")
        out[i] = option_scores(p, score)[int(y)]
    return out


def conformal_quantile(scores: Sequence[float], alpha: float) -> float:
    """The ceil((n + 1)(1 - alpha))-th smallest of n calibration scores; +inf when n is too small for alpha
    (every option then belongs to the set, which is the only way to keep the guarantee)."""
    alpha = _check_alpha(alpha)
    s = np.sort(np.asarray(scores, dtype=np.float64))
    if s.ndim != 1 or len(s) == 0:
        raise ValueError("conformal_quantile needs at least one calibration score")
    rank = math.ceil((len(s) + 1) * (1.0 - alpha))
    return math.inf if rank > len(s) else float(s[rank - 1])


def prediction_set(probs: Sequence[float], quantile: float, score: str) -> list[int]:
    """Indices of the options whose score is at most ``quantile``, most probable first; never empty."""
    p = np.asarray(probs, dtype=np.float64)
    s = option_scores(p, score)
    # A small tolerance: a score equal to the quantile must not drop out through float rounding.
    keep = [int(i) for i in np.argsort(-p, kind="stable") if s[i] <= quantile + 1e-9]
    return keep or [int(np.argmax(p))]


def calibrate_quantiles(probs, labels, alphas: Sequence[float], scores: Sequence[str] = SCORES) -> dict:
    """``{score: {str(alpha): quantile}}`` from one calibration sample (JSON-ready: +inf becomes None)."""
    out: dict = {}
    for score in scores:
        s = label_scores(probs, labels, score)
        qs = {}
        for alpha in alphas:
            q = conformal_quantile(s, alpha)
            qs[alpha_key(alpha)] = None if math.isinf(q) else q
        out[_check_score(score)] = qs
    return out


def alpha_key(alpha: float) -> str:
    """How an alpha is written as a JSON key: ``0.1`` -> ``"0.1"``."""
    return f"{_check_alpha(alpha):g}"


__all__ = ["SCORES", "option_scores", "label_scores", "conformal_quantile", "prediction_set",
           "calibrate_quantiles", "alpha_key"]
