"""Split-conformal prediction sets over a question's options: coverage 1 - alpha, marginal or training-conditional.

Two non-conformity scores of a question's predictive probabilities p (C,) and an option y:

- ``lac`` (least ambiguous set-valued classifier, Sadinle et al. 2019): s = 1 - p_y. Smallest sets on average.
- ``aps`` (adaptive prediction sets, Romano et al. 2020): s = the total probability of the options ranked
  above y plus half of p_y. Sets grow with the question's ambiguity. APS randomises the share of p_y by
  U ~ Uniform(0, 1); its mean U = 1/2 keeps answers deterministic, and the guarantee holds for any fixed score.
  (The variant that adds all of p_y over-covers: 0.946 for a nominal 0.90 on the SciQ validation calibration part.)

Calibration takes the scores of the true answers of n labelled questions and keeps their k-th smallest q; the set
of a new question is every option whose score is at most q. Sets never come out empty: an empty LAC set takes the
top option, which can only raise coverage. Two ways to choose k:

- *marginal* (``delta`` None): k = ceil((n + 1)(1 - alpha)). If the calibration and served questions are
  exchangeable, the set holds the right answer with probability at least 1 - alpha, an average over the draw of the
  calibration sample too (Vovk et al. 2005; Angelopoulos & Bates 2021). The coverage of the one set rule a service
  serves is Beta(k, n + 1 - k) distributed around that: with n = 700 and alpha = 0.1 it is below 0.9 in about half
  of all calibrations, and labelled feedback will find that out.
- *training-conditional* (PAC, ``delta`` given): k is the smallest rank with P(Binomial(n, 1 - alpha) >= k) <= delta.
  The served rule's own coverage F(q) is at least the coverage of the k-th smallest of n uniforms, and
  P(U_(k) < 1 - alpha) = P(Binomial(n, 1 - alpha) >= k), so with probability at least 1 - delta over the
  calibration draw, the rule that is served covers at least 1 - alpha of exchangeable questions (Vovk 2012,
  "Conditional validity of inductive conformal predictors"; Bates et al. 2021, "Distribution-free,
  risk-controlling prediction sets"). The price is a slightly larger rank: 644 instead of 631 of 700 at
  alpha 0.1 and delta 0.05.

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
    for i, (p, y) in enumerate(zip(probs, labels, strict=True)):
        if not 0 <= int(y) < len(p):
            raise ValueError(f"label {y} of question {i} is outside its {len(p)} options")
        out[i] = option_scores(p, score)[int(y)]
    return out


def _check_delta(delta: float | None) -> float | None:
    if delta is not None and (isinstance(delta, bool) or not 0.0 < float(delta) < 1.0):
        raise ValueError(f"delta must be in (0, 1) or None (marginal coverage), got {delta!r}")
    return None if delta is None else float(delta)


def conformal_rank(n: int, alpha: float, delta: float | None = None) -> int:
    """Which of n sorted calibration scores is the quantile (1-based; n + 1 when n is too small): marginal
    ceil((n + 1)(1 - alpha)) without ``delta``, else the smallest k with P(Binomial(n, 1 - alpha) >= k) <= delta."""
    alpha, delta = _check_alpha(alpha), _check_delta(delta)
    if n < 1:
        raise ValueError(f"conformal_rank needs n >= 1 calibration scores, got {n}")
    if delta is None:
        return math.ceil((n + 1) * (1.0 - alpha))
    from scipy.stats import binom

    # P(Binomial >= k) = sf(k - 1): the smallest m = k - 1 with sf(m) <= delta, from the quantile function, then
    # made exact against floating point in either direction.
    k = int(binom.ppf(1.0 - delta, n, 1.0 - alpha)) + 1
    while k > 1 and binom.sf(k - 2, n, 1.0 - alpha) <= delta:
        k -= 1
    while k <= n and binom.sf(k - 1, n, 1.0 - alpha) > delta:
        k += 1
    return k


def conformal_quantile(scores: Sequence[float], alpha: float, delta: float | None = None) -> float:
    """The :func:`conformal_rank`-th smallest of n calibration scores (marginal without ``delta``, PAC with it);
    +inf when n is too small for alpha and delta (every option then belongs to the set, which is the only way to
    keep the guarantee)."""
    s = np.sort(np.asarray(scores, dtype=np.float64))
    if s.ndim != 1 or len(s) == 0:
        raise ValueError("conformal_quantile needs at least one calibration score")
    rank = conformal_rank(len(s), alpha, delta)
    return math.inf if rank > len(s) else float(s[rank - 1])


def prediction_set(probs: Sequence[float], quantile: float, score: str, never_empty: bool = True) -> list[int]:
    """Indices of the options whose score is at most ``quantile``, most probable first; when none is, the most
    probable option alone (``never_empty``, what an answer shows) or nothing (what an adaptive threshold counts:
    ibedl.engine.adaptive)."""
    p = np.asarray(probs, dtype=np.float64)
    s = option_scores(p, score)
    # A small tolerance: a score equal to the quantile must not drop out through float rounding.
    keep = [int(i) for i in np.argsort(-p, kind="stable") if s[i] <= quantile + 1e-9]
    return keep or ([int(np.argmax(p))] if never_empty else [])


def calibrate_quantiles(probs, labels, alphas: Sequence[float], scores: Sequence[str] = SCORES,
                        delta: float | None = None) -> dict:
    """``{score: {str(alpha): quantile}}`` from one calibration sample (JSON-ready: +inf becomes None); PAC at
    ``delta`` when given, else marginal."""
    out: dict = {}
    for score in scores:
        s = label_scores(probs, labels, score)
        qs = {}
        for alpha in alphas:
            q = conformal_quantile(s, alpha, delta)
            qs[alpha_key(alpha)] = None if math.isinf(q) else q
        out[_check_score(score)] = qs
    return out


def alpha_key(alpha: float) -> str:
    """How an alpha is written as a JSON key: ``0.1`` -> ``"0.1"``."""
    return f"{_check_alpha(alpha):g}"


__all__ = ["SCORES", "option_scores", "label_scores", "conformal_rank", "conformal_quantile", "prediction_set",
           "calibrate_quantiles", "alpha_key"]
