"""How long the model takes: a running estimate of seconds per prompt token, measured on the forward passes
the service runs, and the admission arithmetic built on it.

The predictor runs each micro-batch in groups of similar prompt length (``Predictor.predict``), so a pass
costs about its real tokens times a per-token time; that time depends on how full the batches are and on
what else the CPU runs, so it is an exponentially weighted mean of recent passes rather than a constant.
"""

from __future__ import annotations

import math


class ServiceTime:
    """Seconds per prompt token, an exponentially weighted mean over recent forward passes.

    Args:
        per_token_s: the first estimate (the service measures one warm-up pass at load); 0 means unknown,
            which admits everything until the first pass is measured.
        weight: weight of the newest pass in the mean (0 < weight <= 1).
    """

    def __init__(self, per_token_s: float = 0.0, weight: float = 0.2) -> None:
        if not per_token_s >= 0 or math.isinf(per_token_s):
            raise ValueError(f"per_token_s must be a finite number >= 0, got {per_token_s}")
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.per_token_s = per_token_s
        self.weight = weight
        self.passes = 0

    def observe(self, tokens: int, seconds: float) -> None:
        """Fold in one forward pass of ``tokens`` prompt tokens that took ``seconds``."""
        if tokens <= 0 or not seconds >= 0 or math.isinf(seconds):
            return
        rate = seconds / tokens
        first = self.passes == 0 and self.per_token_s == 0
        self.per_token_s = rate if first else (1 - self.weight) * self.per_token_s + self.weight * rate
        self.passes += 1

    def seconds(self, tokens: int | float) -> float:
        """Expected model time for ``tokens`` prompt tokens."""
        return self.per_token_s * tokens


def fair_share_wait(own_tokens: int, queued: list[int], inflight_left_s: float, service: ServiceTime) -> float:
    """Expected seconds until a request of ``own_tokens`` is answered when it joins a queue served fairly.

    Requests take turns (one question each per turn), so before this one finishes every queued request is
    served at most as many tokens as this one needs: the wait is the pass in flight plus
    ``sum(min(q, own_tokens) for q in queued) + own_tokens`` tokens of model time.

    Args:
        own_tokens: prompt tokens of the new request (all its questions).
        queued: prompt tokens still waiting, one entry per queued request.
        inflight_left_s: expected seconds left of the forward pass running now (0 when idle).
    """
    ahead = sum(min(q, own_tokens) for q in queued)
    return max(0.0, inflight_left_s) + service.seconds(ahead + own_tokens)
