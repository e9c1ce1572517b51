"""What the engine refuses, as typed exceptions without HTTP: each has a ``type`` (the error body's ``type``), a
``message`` and the ``field`` it is about (``items.3.options``; None when none). The HTTP service maps each type
to its status code in one place (``ibedl.serve.errors.STATUS``); the Python API (``ibedl``) raises them as they
are. ``retry_after`` (seconds, or None) says when trying again may succeed.
"""

from __future__ import annotations

import math
import re


class EngineError(Exception):
    """A refusal of the engine: ``type``, ``message``, ``field``, ``retry_after``; ``reason``: for a request the
    scheduler refused, why (the ``ibedl_rejected_total`` label it is counted under), else None."""

    type = "engine_error"
    reason: str | None = None

    def __init__(self, message: str, field: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.message, self.field, self.retry_after = message, field, retry_after

    def body(self) -> dict:
        """The error body both front doors write: ``{"error": {"type", "message", "field"}}``."""
        return error_body(self.type, self.message, self.field)


class InvalidRequest(EngineError):
    """A question the engine will not answer as asked (a rule of the request is broken); ``field`` names where."""

    type = "invalid_request"


class UnknownAdapter(InvalidRequest):
    """A request names an adapter that is not loaded."""


class TooLarge(EngineError):
    """A request over a limit (characters, prompt tokens, items); ``field`` names which."""

    type = "too_large"


def too_many_items(count: int, limit: int) -> str:
    """What a request of ``count`` items over the ``limit`` of IBEDL_MAX_BATCH_ITEMS is told, wherever it is counted."""
    return f"{count} items; the limit is {limit}"


class ModelError(EngineError):
    """The model's numbers for a question were not finite: never an answer (the same question gives the same
    numbers, so retrying does not help). ``nonfinite``: how many of the request's questions had them."""

    type = "model_error"

    def __init__(self, message: str, field: str | None = None, nonfinite: int = 0) -> None:
        super().__init__(message, field)
        self.nonfinite = nonfinite


class NotReady(EngineError):
    """The adapters are not loaded (loading, broken) or the engine is draining."""

    type = "not_ready"


class Overloaded(EngineError):
    """No answer is possible before the request's deadline (``reason`` capacity). ``wait_s``: seconds from now after
    which it would be (None: no estimate); ``retry_after`` is that in whole seconds, at least 1. ``cause``: the
    message without the advice to retry."""

    type = "overloaded"
    reason = "capacity"

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(f"{message}; retry after the Retry-After seconds",
                         retry_after=None if retry_after is None else max(1, math.ceil(retry_after)))
        self.wait_s, self.cause = retry_after, message


class QueueFull(Overloaded):
    """More questions than the scheduler's queue holds (a hard bound on memory, checked before capacity)."""

    reason = "queue_full"

    def __init__(self, message: str) -> None:
        super().__init__(f"too many questions waiting ({message})", retry_after=1.0)


class NeedsTooLong(Overloaded):
    """The request alone needs more model time than its deadline allows at the current speed, even on an idle
    engine (the speed may recover: ``wait_s`` is how much too slow it is now)."""


class ShuttingDown(EngineError):
    """The engine is shutting down and will not answer this request (not admitted, or it cannot finish within the
    grace period)."""

    type = "shutting_down"
    reason = "shutting_down"

    def __init__(self, message: str, retry_after: int | None = 1) -> None:
        super().__init__(message, retry_after=retry_after)


class Timeout(EngineError):
    """No answer before the request's deadline."""

    type = "timeout"
    reason = "timeout"


class DeadlineExceeded(Timeout):
    """The request's deadline passed while its question was queued; it never reached the model."""


class Cancelled(EngineError):
    """The caller went away before the answer."""

    type = "client_closed_request"
    reason = "client_gone"


UNION_TAG = re.compile(r"^[a-z-]+\[.*\]$")  # pydantic's name for a member of a union in a location: list[str]


def _is_tag(part) -> bool:
    return isinstance(part, str) and UNION_TAG.match(part) is not None


def field_of(loc, where: tuple[str, ...] = ()) -> str | None:
    """The path of the bad input of a validation error's location in a client's terms (``items.3.options.0``,
    ``adapter``): without the union member pydantic tried, nor a first part of ``where`` (a door's request part)."""
    parts = [str(p) for i, p in enumerate(loc) if not (i == 0 and p in where) and not _is_tag(p)]
    return ".".join(parts) or None


def _not_taken(error: dict, errors: list[dict]) -> bool:
    """Whether ``error`` is a union member the input did not take: it ends at the member's tag while another
    member of the same union got further into the input (``options`` a map: the list member's "a valid list")."""
    loc = tuple(error.get("loc") or ())
    if not loc or not _is_tag(loc[-1]):
        return False
    k = len(loc) - 1
    return any(len(o.get("loc") or ()) > k + 1 and tuple(o["loc"][:k]) == loc[:k] and _is_tag(o["loc"][k])
               for o in errors)


def first_error(errors: list[dict]) -> dict:
    """The validation error to tell of: the first that is not a union member its input did not take (``options``
    as a map with a number among its values: that value, not "Input should be a valid list")."""
    for e in errors:
        if not _not_taken(e, errors):
            return e
    return errors[0] if errors else {"loc": (), "msg": "invalid request"}


def described(errors: list[dict], where: tuple[str, ...] = ()) -> tuple[str, str | None]:
    """(message, field) of pydantic's validation ``errors``: :func:`first_error`'s, where its input took no union
    member the members' messages joined ("a valid list or a valid dictionary"), and "(and N more)" counting the
    other inputs in error, not the members an input did not take."""
    first = first_error(errors)
    field = field_of(first.get("loc", ()), where)
    here = [e for e in errors if field_of(e.get("loc", ()), where) == field]  # one input's errors, one per member
    message = " or ".join([first["msg"], *(e["msg"].removeprefix("Input should be ") for e in here
                                           if e is not first and e["msg"] != first["msg"])])
    others = len({field_of(e.get("loc", ()), where) for e in errors if not _not_taken(e, errors)} - {field})
    return (message + (f" (and {others} more)" if others else "")), field


def error_body(type_: str, message: str, field: str | None = None) -> dict:
    """The one error shape: ``{"error": {"type", "message", "field"}}``."""
    return {"error": {"type": type_, "message": message, "field": field}}


class FeedbackDisabled(EngineError):
    """Feedback is off: no receipt key is configured (``IBEDL_FEEDBACK_KEY``), so answers carry no receipt."""

    type = "feedback_disabled"


class InvalidReceipt(EngineError):
    """A receipt that this service did not sign (unknown, tampered with, or signed with another key)."""

    type = "invalid_receipt"


class ReceiptExpired(EngineError):
    """A receipt past its expiry (``IBEDL_FEEDBACK_TTL_S`` after the answer)."""

    type = "receipt_expired"


class AdapterNotServed(EngineError):
    """A receipt of an adapter version that is no longer served: its label cannot count for what is served now."""

    type = "adapter_not_served"


class LabelConflict(EngineError):
    """A label for a receipt that was recorded before with another label: the first label stands. ``adapters``
    names the adapter of each conflicting item (what the service counts them by)."""

    type = "label_conflict"

    def __init__(self, message: str, field: str | None = None, adapters: tuple[str, ...] = ()) -> None:
        super().__init__(message, field)
        self.adapters = tuple(adapters)


class TooManyLabels(EngineError):
    """The labelling credential has recorded as many labels as its window allows: try again after
    ``retry_after`` seconds."""

    type = "too_many_labels"


class StoreUnavailable(EngineError):
    """The feedback store did not answer within its timeout (``IBEDL_FEEDBACK_TIMEOUT_S``: another writer's lock, a
    slow or unreachable server): try again after ``retry_after`` seconds. A label whose request timed out may have
    been recorded all the same; sending it again is then a duplicate."""

    type = "store_unavailable"
