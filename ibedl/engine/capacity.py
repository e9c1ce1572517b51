"""How long the model takes: a running estimate of seconds per prompt token, measured on the forward passes
the service runs, and the admission arithmetic built on it.

The predictor runs each micro-batch in groups of similar prompt length (``Predictor.predict``), so a pass
costs about its real tokens times a per-token time; that time depends on how full the batches are and on
what else the CPU runs, so it is an exponentially weighted mean of recent passes rather than a constant. Under
``IBEDL_PAD_FREELY`` a pass runs padded to its longest prompt: the time per real token then includes the padding
the recent passes carried, on average.
"""

from __future__ import annotations

import dataclasses
import math
import time

from ibedl.core.backends import preparation
from ibedl.core.predictor import Predictor, count_prompt_tokens
from ibedl.core.prompt import MCQuestion


class ServiceTime:
    """Seconds per prompt token, a mean over recent forward passes that forgets over a fixed amount of work.

    A pass of ``n`` tokens moves the estimate toward its own rate with weight ``1 - exp(-n / horizon_tokens)``:
    a single short question barely moves it, a full pass moves it a lot, so the estimate follows the batches
    the service actually runs under load.

    Args:
        per_token_s: the first estimate (the service measures one warm-up pass at load); 0 means unknown,
            which admits everything until the first pass is measured.
        horizon_tokens: how many tokens of work the estimate remembers (about).
    """

    def __init__(self, per_token_s: float = 0.0, horizon_tokens: float = 8192.0) -> None:
        if not per_token_s >= 0 or math.isinf(per_token_s):
            raise ValueError(f"per_token_s must be a finite number >= 0, got {per_token_s}")
        if not horizon_tokens > 0 or math.isinf(horizon_tokens):
            raise ValueError(f"horizon_tokens must be a finite number > 0, got {horizon_tokens}")
        self.per_token_s = per_token_s
        self.horizon_tokens = horizon_tokens
        self.passes = 0

    def observe(self, tokens: int, seconds: float) -> None:
        """Fold in one forward pass of ``tokens`` prompt tokens that took ``seconds``."""
        if tokens <= 0 or not seconds >= 0 or math.isinf(seconds):
            return
        rate = seconds / tokens
        if self.passes == 0 and self.per_token_s == 0:
            self.per_token_s = rate
        else:
            weight = 1.0 - math.exp(-tokens / self.horizon_tokens)
            self.per_token_s += weight * (rate - self.per_token_s)
        self.passes += 1

    def seconds(self, tokens: int | float) -> float:
        """Expected model time for ``tokens`` prompt tokens."""
        return self.per_token_s * tokens


def round_robin_wait(own: list[int], queued: list[list[int]], inflight_left_s: float, service: ServiceTime) -> float:
    """Expected seconds until a new request is answered when it joins requests that take turns.

    Each turn takes one question from every waiting request, so before the new request's k-th (last)
    question is answered, each queued request has had its first k questions answered too: the wait is the
    pass in flight plus the tokens of ``own`` and of the first ``len(own)`` questions of each queued request.

    Args:
        own: prompt tokens of each question of the new request.
        queued: prompt tokens of each waiting question, one list per queued request, in its order.
        inflight_left_s: expected seconds left of the forward pass running now (0 when idle).
    """
    k = len(own)
    ahead = sum(sum(q[:k]) for q in queued)
    return max(0.0, inflight_left_s) + service.seconds(ahead + sum(own))


def round_robin_finish(queued: list[list[int]], inflight_left_s: float, service: ServiceTime) -> list[float]:
    """Expected seconds until each queued request (prompt tokens of its waiting questions, in turn order)
    is answered, serving one question of each in turn."""
    finish = [0.0] * len(queued)
    t = max(0.0, inflight_left_s)
    for turn in range(max((len(q) for q in queued), default=0)):
        for i, q in enumerate(queued):
            if turn < len(q):
                t += service.seconds(q[turn])
                if turn == len(q) - 1:
                    finish[i] = t
    return finish


PROBE = MCQuestion(  # short question and options: its passage is cut to fit any served token limit
    "Which one?",
    ("this", "that", "neither", "both"),
    " ".join(["The service times one forward pass of a question of typical length before it reports ready."] * 8),
)


def warm_up(predictors: list[Predictor]) -> ServiceTime:
    """Time the model on one question of typical length (the second pass of the first adapter: the first pass of
    each pays its one-time costs), as the first estimate of seconds per prompt token; every served pass refines it."""
    def probe(predictor: Predictor) -> MCQuestion:  # as many options as its head scores, at most four
        return dataclasses.replace(PROBE, options=PROBE.options[: min(len(PROBE.options), predictor.num_rows)])

    for predictor in predictors:
        for step in preparation(predictor.trunk):  # e.g. CUDA graphs, captured on this thread: the model's
            step()
        predictor.predict([probe(predictor)])  # its passage is cut to the served limit
    first = predictors[0]
    tokens = min(count_prompt_tokens(first.tokenizer, first.template, probe(first)), first.max_tokens)
    start = time.perf_counter()
    first.predict([probe(first)])
    return ServiceTime((time.perf_counter() - start) / tokens)
