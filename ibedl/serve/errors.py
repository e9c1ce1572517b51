"""One error shape per protocol, for every status: ``{"error": {"type", "message", "field"}}`` on the v1 routes, the
Open Inference Protocol's ``{"error": "<type>: <message>"}`` under ``/v2/``; and the handlers that answer them. The
engine's refusals (``ibedl.engine.errors``) carry no HTTP status: :data:`STATUS` is the one place that gives each its
status code, and the ``EngineError`` handler the one place that answers them."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ibedl.engine.errors import EngineError, UnknownAdapter, described, error_body, first_error

log = logging.getLogger("ibedl.serve")
OIP_PREFIX = "/v2/"  # the Open Inference Protocol's routes (ibedl.serve.oip): its own error body

# The status of each engine error type (an EngineError's ``type``; a type not here is a bug: 500).
STATUS = {
    "invalid_request": 422,
    "too_large": 413,
    "model_error": 500,  # the model ran: not a refusal (a 503 always is one, and the gateway retries those)
    "not_ready": 503,
    "overloaded": 503,
    "shutting_down": 503,
    "timeout": 504,
    "client_closed_request": 499,
    "feedback_disabled": 404,
    "invalid_receipt": 422,
    "receipt_expired": 410,
    "adapter_not_served": 409,
    "label_conflict": 409,
    "too_many_labels": 429,
    "store_unavailable": 503,  # the feedback store did not answer in time: a refusal, retried elsewhere
}


def status_of(exc: EngineError) -> int:
    """The HTTP status an engine error is answered with."""
    return STATUS.get(exc.type, 500)


def engine_error_response(exc: EngineError, path: str = "") -> JSONResponse:
    """The answer to an engine error: its status, its body, and ``Retry-After`` when it says when to retry."""
    headers = None if exc.retry_after is None else {"Retry-After": str(exc.retry_after)}
    status = status_of(exc)
    if path.startswith(OIP_PREFIX) and isinstance(exc, UnknownAdapter):
        status = 404  # the protocol's "no such model" (v1 keeps 422: the adapter is a field of the request)
    return error_response(status, exc.type, exc.message, exc.field, headers, path)


def error_response(status: int, type_: str, message: str, field: str | None = None,
                   headers: dict | None = None, path: str = "") -> JSONResponse:
    return JSONResponse(body_for(path, type_, message, field), status_code=status, headers=headers)


def body_for(path: str, type_: str, message: str, field: str | None = None) -> dict:
    """The error body of the protocol ``path`` belongs to (the Open Inference Protocol's under ``/v2/``)."""
    if path.startswith(OIP_PREFIX):
        return {"error": f"{type_}: {message}"}
    return error_body(type_, message, field)


WHERE = ("body", "query", "path", "header")  # the request part FastAPI puts first in a location


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(EngineError)
    async def engine_error(request: Request, exc: EngineError):
        return engine_error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = first_error(errors)
        if first.get("type") == "json_invalid":
            return error_response(422, "invalid_json",
                                  f"request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}",
                                  path=request.url.path)
        if first.get("type") == "too_large":  # ibedl.engine.schemas.ITEMS_LIMIT: refused before its items were read
            return error_response(413, "too_large", first["msg"], "items", path=request.url.path)
        if first.get("type") == "missing" and tuple(first.get("loc", ())) == ("body",):
            return error_response(422, "invalid_json", "the request body is empty: send a JSON object",
                                  path=request.url.path)
        message, field = described(errors, WHERE)
        return error_response(422, "invalid_request", message, field, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        types = {400: "invalid_body", 404: "not_found", 405: "method_not_allowed"}
        # FastAPI's only 400: json.loads failing otherwise than on the JSON's syntax (not UTF-8, nested too deep)
        detail = ("the body is not JSON this service reads: not UTF-8 text, or nested deeper than the parser allows"
                  if exc.status_code == 400 else str(exc.detail))
        return error_response(exc.status_code, types.get(exc.status_code, "http_error"), detail,
                              headers=getattr(exc, "headers", None), path=request.url.path)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "internal_error", "internal error; see the service log", path=request.url.path)
