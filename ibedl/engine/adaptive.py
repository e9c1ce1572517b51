"""Adaptive conformal sets from feedback: the set threshold follows the labels so that the long-run miscoverage
stays at alpha on any sequence of questions, exchangeable or not (adaptive conformal inference, Gibbs & Candès
2021, in its quantile-tracking form, Angelopoulos, Candès & Tibshirani 2023).

After each labelled question whose adaptive set missed (err = 1) or held (err = 0) the right option,

    q <- q + rate * (err - alpha)

so misses widen the sets and hits narrow them. For scores in [0, B] and any sequence of T labels,
|mean(err) - alpha| <= (B + rate) / (rate * T) (Angelopoulos et al. 2023, Prop. 1), whatever the traffic. The bound
needs the rule's own set, which is empty once q falls below every option's score: that empty set is a miss, and the
misses are what stop q from falling further (q stays within [-alpha * rate, B + (1 - alpha) * rate]). An answer
shows the most probable option alone in its place, which covers at least as often, so the shown sets' long-run
miscoverage is at most alpha + (B + rate) / (rate * T). All this when each label is folded before the next question
is answered; when up to D labels are folded between an answer and its own label (late, batched, from several
replicas), the range widens by rate * D each way and the bound becomes (B + rate * (D + 1)) / (rate * T).
Counting the shown set instead let q fall without limit while top-1 accuracy exceeded 1 - alpha (to -8 after 20,000
such labels at rate 0.01), and after a shift the sets stayed too small for thousands of labels while q climbed back.
It is a long-run frequency on the labelled stream, not the exchangeable guarantee of the calibrated sets (which holds
for every question, on traffic like the calibration sample): the service reports the two apart.

References:
    Gibbs, I. & Candès, E. (2021). Adaptive conformal inference under distribution shift. NeurIPS.
    Angelopoulos, A., Candès, E. & Tibshirani, R. (2023). Conformal PID control for time series prediction. NeurIPS.
"""

from __future__ import annotations

SCORE_BOUND = 1.0  # lac (1 - p) and aps scores lie in [0, 1]


class QuantileTracker:
    """The adaptive set threshold of one adapter version.

    Args:
        start: the first threshold (the calibrated conformal quantile).
        alpha: target miscoverage, 0 < alpha < 1.
        rate: step size, > 0 (larger follows shift faster, with noisier sets).
    """

    def __init__(self, start: float, alpha: float, rate: float) -> None:
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {alpha}")
        if not rate > 0.0:
            raise ValueError(f"rate must be > 0, got {rate}")
        self.alpha, self.rate = float(alpha), float(rate)
        self.start = min(max(float(start), 0.0), SCORE_BOUND)
        # (labels, misses), replaced as one: answering reads the threshold on the event loop, without the lock the
        # store's thread folds labels under, and must never see the labels of one fold with the misses of another
        self._counts = (0, 0)

    @property
    def labels(self) -> int:
        return self._counts[0]

    @property
    def misses(self) -> int:
        return self._counts[1]

    @property
    def quantile(self) -> float:
        """The threshold now: the rule's steps summed, start + rate * (misses - alpha * labels), so the threshold
        of a tracker restored from its counts (a replica that starts from the feedback store's states) is the one
        of a tracker that saw every label, bit for bit."""
        labels, misses = self._counts
        return self.start + self.rate * (misses - self.alpha * labels)

    def update(self, covered: bool) -> None:
        """One labelled question: whether its adaptive set held the right option."""
        labels, misses = self._counts
        self._counts = (labels + 1, misses + int(not covered))

    def restore(self, labels: int, misses: int) -> None:
        """Take the counts a checkpoint holds (0 <= misses <= labels)."""
        if not 0 <= misses <= labels:
            raise ValueError(f"need 0 <= misses <= labels, got misses {misses}, labels {labels}")
        self._counts = (int(labels), int(misses))
