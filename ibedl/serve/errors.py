"""One error shape for every failure: ``{"error": {"type", "message", "field"}}``, and its handlers. FastAPI is
imported by the handlers only: the Python API (``ibedl``) raises the same ApiError without it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

log = logging.getLogger("ibedl.serve")


class ApiError(Exception):
    """An error answered to the client as-is (the Python API raises it too: ``status``, ``type``, ``message``,
    ``field``)."""

    def __init__(self, status: int, type_: str, message: str, field: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.type, self.message, self.field, self.headers = status, type_, message, field, headers or {}


def error_body(type_: str, message: str, field: str | None = None) -> dict:
    return {"error": {"type": type_, "message": message, "field": field}}


def error_response(status: int, type_: str, message: str, field: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    from fastapi.responses import JSONResponse

    return JSONResponse(error_body(type_, message, field), status_code=status, headers=headers)


def _field(loc) -> str | None:
    parts = [str(p) for p in loc if p not in ("body",)]
    return ".".join(parts) or None


def install_handlers(app: FastAPI) -> None:
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return error_response(exc.status, exc.type, exc.message, exc.field, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            return error_response(422, "invalid_json",
                                  f"request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
        message = first["msg"]
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more)"
        return error_response(422, "invalid_request", message, _field(first.get("loc", ())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        types = {400: "invalid_body", 404: "not_found", 405: "method_not_allowed"}  # 400: a body that is not UTF-8
        return error_response(exc.status_code, types.get(exc.status_code, "http_error"), str(exc.detail),
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "internal_error", "internal error; see the service log")
