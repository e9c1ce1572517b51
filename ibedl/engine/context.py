"""What the engine knows of one request, whatever door it came through: its id, when it arrived (the admission
clock's time), whether it was admitted on arrival, the deadline the caller asked for and how to tell that the caller
went away. Every door makes one with :meth:`ibedl.engine.engine.Engine.arrive` and hands it to the engine."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

TIMEOUT_HEADER = "X-Request-Timeout"  # where an HTTP caller states its own deadline (gRPC: the call's deadline)


@dataclass
class RequestContext:
    """One request as the engine sees it.

    Attributes:
        arrived: the admission clock's time when the request arrived (deadlines count from here).
        admitted: whether the engine accepted requests then; one admitted before a drain began is answered if it can
            finish within the grace period, one that arrives after it is refused.
        timeout: the caller's own deadline in seconds after arrival, as it sent it (HTTP's ``X-Request-Timeout``
            header; gRPC's deadline); None: the engine's request timeout. A value that is not a positive number is
            refused (InvalidRequest) when the deadline is first needed.
        request_id: the id in logs and in answers that carry none (default: a new 32-hex id).
        gone: gives an awaitable that completes when the caller goes away (its queued questions are dropped).
        adapter: the adapter the engine chose for it, once known (for the door's access log).
    """

    arrived: float
    admitted: bool
    timeout: str | float | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    gone: Callable[[], Awaitable] | None = None
    adapter: str | None = None
