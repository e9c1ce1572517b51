"""Risk-controlled abstention: a confidence threshold whose answered accuracy is at least a target with
probability at least 1 - delta, by Learn-Then-Test (Angelopoulos, Bates, Candes, Jordan, Lei 2021).

The family: answer a question when its confidence (max probability) is at least lambda. For each candidate
lambda, the null hypothesis "the error rate among answered questions exceeds epsilon = 1 - target" gets the
exact binomial p-value P(Binomial(n_lambda, epsilon) <= errors_lambda) from the n_lambda calibration
questions it answers. Candidates are tested in a fixed sequence from the strictest lambda (fewest answers)
down and testing stops at the first null not rejected at level delta; every lambda rejected before that is
certified, and the loosest of them (most answers) is kept. Fixed-sequence testing controls the family-wise
error at delta, so: if calibration and served questions are exchangeable, the chosen threshold's answered
accuracy is at least the target with probability at least 1 - delta over the draw of the calibration sample.

References:
    Angelopoulos et al. Learn then Test: Calibrating Predictive Algorithms to Achieve Risk Control. 2021.
    Clopper & Pearson. The use of confidence or fiducial limits illustrated in the case of the binomial. 1934.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from scipy.stats import beta as beta_dist
from scipy.stats import binom

GRID = 200  # candidate thresholds: quantiles of the calibration confidences
# The sequence starts at the threshold answering this share of the calibration questions (found from the
# confidences alone, before any label is read). Starting stricter spends the whole error budget on a test
# with too few questions to pass: at 20 answers and no error, P(Binomial(20, 0.1) = 0) = 0.12 > delta = 0.1.
START_COVERAGE = 0.1
# ... and at no fewer answers than twice the fewest that can pass at all (no error among m answers passes once
# (1 - epsilon)^m <= delta: 44 at epsilon 0.1, delta 0.01), so that a few errors still can. Both depend on n,
# epsilon and delta only, never on the labels, so the guarantee is untouched.
START_PASSABLE_FACTOR = 2


def binomial_p_value(errors: int, n: int, epsilon: float) -> float:
    """P(Binomial(n, epsilon) <= errors): small when so few errors are unlikely at an error rate of epsilon."""
    if n < 1 or not 0 <= errors <= n:
        raise ValueError(f"need 0 <= errors <= n and n >= 1, got errors={errors}, n={n}")
    return float(binom.cdf(errors, n, epsilon))


def accuracy_lower_bound(correct: int, n: int, delta: float) -> float:
    """One-sided Clopper-Pearson lower confidence bound (level 1 - delta) on an accuracy of correct / n."""
    if n < 1 or not 0 <= correct <= n:
        raise ValueError(f"need 0 <= correct <= n and n >= 1, got correct={correct}, n={n}")
    return 0.0 if correct == 0 else float(beta_dist.ppf(delta, correct, n - correct + 1))


@dataclass
class RiskControl:
    """The threshold chosen and what it certifies (JSON-ready through ``asdict``)."""

    min_confidence: float
    certified: bool
    target_accuracy: float
    delta: float
    n: int
    answered: int
    coverage: float
    accuracy: float | None
    accuracy_lower_bound: float | None
    p_value: float | None
    candidates_tested: int
    procedure: str = ("learn-then-test: fixed-sequence testing of confidence thresholds from the one answering "
                      "10% of the calibration questions (and at least twice the fewest answers that can pass) down, "
                      "exact binomial p-values")

    def to_dict(self) -> dict:
        return asdict(self)


def control_accuracy(confidence, hits, target_accuracy: float, delta: float,
                     start_coverage: float = START_COVERAGE, grid: int = GRID) -> RiskControl:
    """The loosest confidence threshold certified to keep answered accuracy >= target with prob. >= 1 - delta.

    Args:
        confidence: (N,) max probability of each calibration question (only those the gate lets through).
        hits: (N,) 1 where the top option is the right answer.
        target_accuracy: the accuracy to guarantee on answered questions, in (0, 1).
        delta: the allowed probability that the guarantee fails, in (0, 1).
        start_coverage: the sequence starts at the strictest threshold answering at least this share (and at
            least START_PASSABLE_FACTOR times the fewest answers that can pass at all).

    When no threshold is certified, ``min_confidence`` is 1.0 (answer only certain questions) and
    ``certified`` is False.
    """
    if isinstance(target_accuracy, bool) or not 0.0 < target_accuracy < 1.0:
        raise ValueError(f"target_accuracy must be in (0, 1), got {target_accuracy!r}")
    if isinstance(delta, bool) or not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    conf = np.asarray(confidence, dtype=np.float64)
    hits = np.asarray(hits, dtype=np.float64)
    if conf.shape != hits.shape or conf.ndim != 1:
        raise ValueError(f"confidence and hits must be (N,) of one length, got {conf.shape} and {hits.shape}")
    if not 0.0 < start_coverage <= 1.0:
        raise ValueError(f"start_coverage must be in (0, 1], got {start_coverage!r}")
    n = len(conf)
    passable = math.ceil(math.log(delta) / math.log(1.0 - (1.0 - target_accuracy)))  # (1 - eps)^m <= delta
    min_answered = min(max(1, math.ceil(start_coverage * n), START_PASSABLE_FACTOR * passable), max(n, 1))
    epsilon = 1.0 - target_accuracy
    # Strictest first: thresholds descend, so each candidate answers a superset of the previous one's questions.
    cuts = np.unique(np.quantile(conf, np.linspace(0.0, 1.0, grid + 1)))[::-1] if n else np.array([])
    chosen = None  # (lambda, answered, correct, p)
    tested = 0
    for lam in cuts:
        answered = conf >= lam
        m = int(answered.sum())
        if m < min_answered:
            continue
        tested += 1
        correct = int(hits[answered].sum())
        p = binomial_p_value(m - correct, m, epsilon)
        if p > delta:
            break
        chosen = (float(lam), m, correct, p)
    if chosen is None:
        return RiskControl(1.0, False, target_accuracy, delta, n, 0, 0.0, None, None, None, tested)
    lam, m, correct, p = chosen
    return RiskControl(
        min_confidence=lam, certified=True, target_accuracy=target_accuracy, delta=delta, n=n, answered=m,
        coverage=m / n, accuracy=correct / m, accuracy_lower_bound=accuracy_lower_bound(correct, m, delta),
        p_value=p, candidates_tested=tested,
    )


__all__ = ["RiskControl", "control_accuracy", "binomial_p_value", "accuracy_lower_bound"]
