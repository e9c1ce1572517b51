"""Risk-controlled abstention: a confidence threshold whose answered accuracy is at least a target with
probability at least 1 - delta, by Learn-Then-Test (Angelopoulos, Bates, Candes, Jordan, Lei 2021).

The family: answer a question when its confidence (max probability) is at least lambda. For each candidate
lambda, the null hypothesis "the error rate among answered questions exceeds epsilon = 1 - target" gets the
exact binomial p-value P(Binomial(n_lambda, epsilon) <= errors_lambda) from the n_lambda calibration
questions it answers. Candidates are tested in a fixed sequence from a start lambda_0 towards looser thresholds
(more answers), and testing stops at the first null not rejected at level delta; every lambda rejected before that
is certified, and the loosest of them is kept. Fixed-sequence testing controls the family-wise error at delta
whatever the order, as long as the order does not depend on the calibration questions' labels, so: if
calibration and served questions are exchangeable, the chosen threshold's answered accuracy is at least the target
with probability at least 1 - delta over the draw of the calibration sample.

Where the sequence starts decides what can be certified: a start too strict answers too few questions for any
p-value to pass (no error among 20 answers: P = 0.9^20 = 0.12 > 0.01) and the sequence stops there, certifying
nothing, although looser thresholds would pass. Two starts, neither reading the calibration part's labels:

- with a *pilot* sample (``start_from``: the confidences and hits of other labelled questions, the fit part
  ibedl.training.calibrate keeps apart), the start is the threshold most likely to pass, predicted from the
  pilot's answered share and (smoothed) error rate at the calibration part's size (:func:`pilot_start`). The
  calibration part is independent of the pilot, so the guarantee is untouched.
- without one, the strictest threshold answering 10% of the calibration questions (found from the confidences
  alone) and at least twice the fewest answers that can pass at all.

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
PROCEDURE_PILOT = ("learn-then-test: fixed-sequence testing of confidence thresholds from the one a pilot sample "
                   "(the fit part) predicts most likely to pass, towards looser ones, exact binomial p-values")
PROCEDURE_LABEL_FREE = ("learn-then-test: fixed-sequence testing of confidence thresholds from the one answering 10% "
                        "of the calibration questions (and at least twice the fewest answers that can pass) down, "
                        "exact binomial p-values")


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
    procedure: str = ""
    start: float | None = None  # the threshold the sequence started at, when a pilot chose it

    def to_dict(self) -> dict:
        return asdict(self)


def control_accuracy(confidence, hits, target_accuracy: float, delta: float,
                     start_coverage: float = START_COVERAGE, grid: int = GRID,
                     start_from: tuple | None = None) -> RiskControl:
    """The loosest confidence threshold certified to keep answered accuracy >= target with prob. >= 1 - delta.

    Args:
        confidence: (N,) max probability of each calibration question (only those the gate lets through).
        hits: (N,) 1 where the top option is the right answer.
        target_accuracy: the accuracy to guarantee on answered questions, in (0, 1).
        delta: the allowed probability that the guarantee fails, in (0, 1).
        start_coverage: without ``start_from``, the sequence starts at the strictest threshold answering at least
            this share (and at least START_PASSABLE_FACTOR times the fewest answers that can pass at all).
        start_from: (confidence (M,), hits (M,)) of a pilot sample independent of the calibration questions: the
            sequence starts at the threshold with the smallest p-value predicted from it (:func:`pilot_start`).

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
    start = None if start_from is None else pilot_start(cuts, n, *start_from, epsilon, delta)
    chosen = None  # (lambda, answered, correct, p)
    tested = 0
    for lam in cuts:
        answered = conf >= lam
        m = int(answered.sum())
        if (m < min_answered) if start is None else (lam > start):
            continue
        tested += 1
        if m == 0:  # a pilot's start that answers none of these questions: nothing can pass there
            break
        correct = int(hits[answered].sum())
        p = binomial_p_value(m - correct, m, epsilon)
        if p > delta:
            break
        chosen = (float(lam), m, correct, p)
    procedure = PROCEDURE_PILOT if start is not None else PROCEDURE_LABEL_FREE
    if chosen is None:
        return RiskControl(1.0, False, target_accuracy, delta, n, 0, 0.0, None, None, None, tested, procedure, start)
    lam, m, correct, p = chosen
    return RiskControl(
        min_confidence=lam, certified=True, target_accuracy=target_accuracy, delta=delta, n=n, answered=m,
        coverage=m / n, accuracy=correct / m, accuracy_lower_bound=accuracy_lower_bound(correct, m, delta),
        p_value=p, candidates_tested=tested, procedure=procedure, start=start,
    )


def pilot_start(cuts, n: int, pilot_confidence, pilot_hits, epsilon: float, delta: float) -> float | None:
    """The candidate threshold of ``cuts`` (descending) where a calibration part of ``n`` questions is most likely to
    pass its test: the largest P(Binomial(m, e) <= c), m = n x the pilot's answered share at the threshold, e its
    error rate among them (Laplace-smoothed, (errors + 1) / (answered + 2): the raw rate of a few answers is
    optimistic exactly where it looks best), c the most errors m answers may hold and pass at level ``delta``.
    None when the pilot answers nothing at any cut, or no cut can pass (then the label-free start applies). Reads
    the pilot only, never the calibration labels.

    Args:
        cuts: (K,) candidate thresholds, strictest first.
        n: calibration questions the sequence will test on.
        pilot_confidence, pilot_hits: (M,) the pilot's confidences and 0/1 hits.
        epsilon: the error rate the nulls exceed (1 - target).
        delta: the test's level.
    """
    conf = np.asarray(pilot_confidence, dtype=np.float64)
    hits = np.asarray(pilot_hits, dtype=np.float64)
    if conf.shape != hits.shape or conf.ndim != 1:
        raise ValueError(f"the pilot's confidence and hits must be (M,) of one length, got {conf.shape} and "
                         f"{hits.shape}")
    best, best_pass = None, 0.0
    for lam in cuts:
        answered = conf >= lam
        if not answered.any():
            continue
        m = max(1, round(n * answered.mean()))
        allowed = int(binom.ppf(delta, m, epsilon))  # then made exact: the most errors with P(B <= c) <= delta
        while allowed >= 0 and binom.cdf(allowed, m, epsilon) > delta:
            allowed -= 1
        while allowed + 1 <= m and binom.cdf(allowed + 1, m, epsilon) <= delta:
            allowed += 1
        if allowed < 0:
            continue
        error = (answered.sum() - hits[answered].sum() + 1.0) / (answered.sum() + 2.0)
        chance = float(binom.cdf(allowed, m, error))
        if chance > best_pass:
            best, best_pass = float(lam), chance
    return best


__all__ = ["RiskControl", "control_accuracy", "pilot_start", "binomial_p_value", "accuracy_lower_bound"]
