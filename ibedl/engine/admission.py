"""Admission: whether a request may enter the queue, decided in one place from a snapshot of the queue.

Pure and clock-injected: :class:`Admission` reads the time from the clock it was given and changes nothing; the
engine asks it before a request's body is read or tokenized (:meth:`Admission.busy_until`, from
``Engine.refuse_early``), the batcher asks it when a request's questions
would join the queue (:meth:`Admission.decide`, with the queue's :class:`QueueSnapshot`); a refusal is an engine error
(``ibedl.engine.errors``) carrying the ``ibedl_rejected_total`` reason it is counted under, raised as it is. The
batcher keeps the queue, the fair turns and the worker.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from ibedl.engine.context import TIMEOUT_HEADER
from ibedl.engine.errors import EngineError, NeedsTooLong, Overloaded, QueueFull, ShuttingDown


class InvalidTimeout(ValueError):
    """The ``X-Request-Timeout`` header is not a positive number of seconds."""


@dataclass(frozen=True)
class QueueSnapshot:
    """What admission needs to know about the queue at one moment (seconds are expected model time).

    Attributes:
        depth: questions waiting.
        queue_size: questions the queue holds, at most.
        expected_wait_s: expected seconds until the new request would be answered (the pass in flight plus its
            turns among the queued requests), before margin and overrun.
        alone_s: expected seconds of model time of the request alone.
        overrun: how much longer than estimated requests have recently taken (>= 1).
        draining: a shutdown has begun.
        drain_end: clock time from which queued work is refused (while draining), or None.
        stopping: the worker is stopping: nothing is admitted.
    """

    depth: int
    queue_size: int
    expected_wait_s: float
    alone_s: float
    overrun: float = 1.0
    draining: bool = False
    drain_end: float | None = None
    stopping: bool = False


class Admission:
    """The admission policy: deadlines from the server's timeout and the client's ``X-Request-Timeout``, and the
    decision to admit a request of ``n`` questions given a :class:`QueueSnapshot` of the queue.

    Args:
        request_timeout_s: the server's deadline for a request, from its arrival.
        margin: a request is admitted only if ``margin`` x its expected completion fits before its deadline.
        clock: monotonic seconds (``time.monotonic``; tests give a fake one).
    """

    def __init__(self, request_timeout_s: float = float("inf"), margin: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s}")
        if not margin >= 1:
            raise ValueError(f"margin must be >= 1, got {margin}")
        self.request_timeout_s = request_timeout_s
        self.margin = margin
        self.clock = clock

    def timeout(self, header: str | None) -> float:
        """Seconds a request may take: the server's timeout, or the client's shorter ``X-Request-Timeout``.

        Raises:
            InvalidTimeout: the header is not a positive, finite number of seconds.
        """
        if header is None:
            return self.request_timeout_s
        try:
            given = float(header)
        except ValueError:
            given = float("nan")
        if not (given > 0 and math.isfinite(given)):
            raise InvalidTimeout(f"{TIMEOUT_HEADER} must be a positive number of seconds, got {header[:40]!r}")
        return min(self.request_timeout_s, given)

    def deadline(self, arrived: float, header: str | None) -> float:
        """Clock time by which a request that ``arrived`` then must be answered (InvalidTimeout as :meth:`timeout`)."""
        return arrived + self.timeout(header)

    def busy_for(self, arrived: float, header: str | None, smallest_wait_s: float) -> float | None:
        """Seconds until even the smallest request (``smallest_wait_s``: the expected wait of one question of no
        tokens) could be answered before this request's deadline; None when it could now, or when the header is
        invalid (the route answers that). Needs no body: the middleware refuses with it before parsing and
        tokenizing, so refusals stay cheap under overload."""
        try:
            return self.busy_until(self.deadline(arrived, header), smallest_wait_s)
        except InvalidTimeout:
            return None

    def busy_until(self, deadline: float, smallest_wait_s: float) -> float | None:
        """:meth:`busy_for` for a request due by ``deadline`` (the admission clock's time)."""
        left = deadline - self.clock()
        lower = self.margin * smallest_wait_s
        return lower - left if lower > left else None

    def decide(self, n: int, tokens: int, deadline: float, queue: QueueSnapshot,
               admitted_before_drain: bool = False) -> EngineError | None:
        """None to admit a request of ``n`` questions and ``tokens`` prompt tokens due by ``deadline``; otherwise
        the refusal (an engine error carrying its ``reason``), in this order: shutting down, the queue's bound,
        too long even alone, not before the deadline. A request with nothing ahead of it (no question waiting, no
        pass in flight) that fits alone is admitted whatever the overrun says: the overrun is learnt from other
        requests' waits (a background build taking the CPU), and a lone sequential client must never be refused."""
        now = self.clock()
        if queue.stopping or (queue.draining and not admitted_before_drain):
            return ShuttingDown("the service is shutting down")
        if n > queue.queue_size - queue.depth:
            return QueueFull(f"{queue.depth} questions are waiting; the queue holds {queue.queue_size}")
        if queue.draining and queue.drain_end is not None and self.margin * queue.expected_wait_s > (
                queue.drain_end - now):
            return ShuttingDown("the service is shutting down and could not answer this request in time")
        if math.isinf(deadline):
            return None
        left = deadline - now
        alone = self.margin * queue.alone_s
        if alone > left:
            return NeedsTooLong(f"the request needs about {alone:.1f} s of model time ({tokens} prompt tokens) "
                                        f"and its deadline leaves {max(left, 0):.1f} s", retry_after=alone - left)
        if queue.depth == 0 and queue.expected_wait_s <= queue.alone_s * (1 + 1e-9):
            return None  # nothing ahead of it: only its own time can refuse it, and it fits; a lone client is served
        expected = self.margin * queue.overrun * queue.expected_wait_s
        if expected > left:
            return Overloaded(f"the service is busy: an answer is expected in {expected:.1f} s and the "
                                       f"deadline leaves {left:.1f} s", retry_after=expected - left)
        return None
