"""One ASGI middleware in front of the routes, in the order a request meets them: request id (the client's when it is a
sane token, as the gateway keeps it, else a new one) and arrival time, admission (decided once, on arrival), the
bearer token (401 before the body is read: every route but the health probes and the docs' static assets takes
IBEDL_API_TOKEN when one is set, so a new route is protected without being listed; /metrics takes
IBEDL_METRICS_TOKEN; the labelling routes take IBEDL_LABEL_TOKEN alone, and answer the API token 403), content type
(415), body size (413) and body-read time (408) checks, HEAD as the GET of the same path without its body (RFC 9110
9.3.2: uptime checkers and some load balancers probe with it), and request count/latency metrics (probe and metrics
paths stay out of them; label values are bounded), and the access log line; the request id is on every log record
written while the request is served (``ibedl.serve.logs``)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid

from starlette.routing import Match

from ibedl.engine.errors import EngineError
from ibedl.engine.schemas import ITEMS_LIMIT
from ibedl.serve import logs
from ibedl.serve.auth import LABEL_PATHS, METRICS_PATH, PROBES, label_access, required_token, token_ok
from ibedl.serve.errors import OIP_PREFIX, body_for, status_of

UNMEASURED = PROBES | {METRICS_PATH}
PREDICT_PATHS = ("/predict", "/predict/batch")  # admission (503 before the body is read) applies to these


def predicts(path: str) -> bool:
    """Whether ``path`` asks questions (admission applies): /predict, /predict/batch, /v2/models/NAME/infer."""
    return path in PREDICT_PATHS or (path.startswith(OIP_PREFIX + "models/") and path.endswith("/infer"))
BODY_METHODS = ("POST", "PUT", "PATCH")
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})  # others count as "other"
# An X-Request-ID the service keeps: what deploy/nginx/nginx.conf keeps (tests/deploy checks the two agree);
# anything else (too long, spaces, control characters) is replaced by a new id.
REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
log = logging.getLogger("ibedl.serve")
CLIENT_GONE = object()  # what _read_body returns when the client disconnected
NOT_MOUNTED = "*"  # _route_path without the service's routes


def choose_request_id(given: str | None) -> str:
    """The request's id: ``given`` (the X-Request-ID header) when it is a sane token, else a new 32-hex id."""
    return given if given is not None and REQUEST_ID.fullmatch(given) else uuid.uuid4().hex


class RequestGuard:
    def __init__(self, app, state, routes: list | None = None) -> None:
        """``routes``: the service's routes (Starlette routes with a ``path``), to know before the router runs which
        one takes a request (None: every body is checked and no route is known before the router's)."""
        self.app = app
        self.state = state
        self.routes = routes

    async def _reply(self, send, status: int, type_: str, message: str, request_id: str, headers=(),
                     path: str = "", field: str | None = None) -> None:
        """An error answered here, in the shape of the protocol ``path`` belongs to."""
        body = json.dumps(body_for(path, type_, message, field)).encode()
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"x-request-id", request_id.encode()), *headers]})
        await send({"type": "http.response.body", "body": body})

    def _refusal(self, scope, headers: dict, path: str) -> tuple[int, str, str, list] | None:
        """(status, type, message, headers) of a refusal decided before the body is read (credentials, labels,
        capacity: a refusal costs next to nothing), or None. Records the labelling credential in the scope."""
        authorization = headers.get("authorization", "")
        bearer = [(b"www-authenticate", b"Bearer")]
        if path in LABEL_PATHS:
            scope["state"]["credential"], refused = label_access(self.state.settings, authorization)
            if refused is not None:
                status, type_, message = refused
                return status, type_, message, bearer if status == 401 else []
        elif not token_ok(required_token(self.state.settings, path), authorization):
            return 401, "unauthorized", "a valid 'Authorization: Bearer <token>' header is required", bearer
        if scope["method"] == "POST" and predicts(path) and scope["state"]["routed"]:
            try:  # no body read, parsed or tokenized: not ready, overloaded or a bad timeout, answered early
                self.state.engine.refuse_early(scope["state"]["context"])
            except EngineError as e:
                retry = [] if e.retry_after is None else [(b"retry-after", str(e.retry_after).encode())]
                return status_of(e), e.type, e.message, retry, e.field
        return None

    async def _buffered(self, headers: dict, receive, oip: bool = False) -> tuple[object, tuple | None]:
        """(a receive that replays the body, None) once it is read whole within the size and time limits, else
        (receive, refusal): 415, 413, 408, or (499, None, ...) when the client went away. ``oip``: an Open
        Inference Protocol body (JSON whether or not it says so: see __call__), never the binary extension."""
        limit, timeout = self.state.settings.max_body_bytes, self.state.settings.body_timeout_s
        ctype = headers.get("content-type", "").split(";")[0].strip().lower()
        if oip and "inference-header-content-length" in headers:
            return receive, (415, "unsupported_media_type", "binary tensor data is not supported: send the tensors "
                             "as JSON (tritonclient: binary_data=False on inputs and outputs)", [])
        if not (ctype == "application/json" or ctype.endswith("+json")):
            return receive, (415, "unsupported_media_type",
                             f"send the body as application/json, not {ctype or 'no content type'}", [])
        coding = headers.get("content-encoding", "identity").strip().lower()
        if coding not in ("", "identity"):
            return receive, (415, "unsupported_media_type",
                             f"the body's Content-Encoding {coding!r} is not supported: send it uncompressed", [])
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return receive, (413, "too_large", f"the body is {length} bytes; the limit is {limit}", [])
        # Without a Content-Length (chunked) the size is only known while reading: read the body here, bounded by
        # the limit, and hand the app the buffered copy.
        try:
            body = await asyncio.wait_for(_read_body(receive, limit), timeout)
        except (asyncio.TimeoutError, TimeoutError):
            return receive, (408, "request_timeout", f"the request body did not arrive within {timeout:g} s",
                             [(b"connection", b"close")])
        if body is CLIENT_GONE:
            return receive, (499, None, "", [])  # nginx's code for a client that closed the request
        if body is None:
            return receive, (413, "too_large", f"the body exceeds the limit of {limit} bytes", [])
        return _replay(body, receive), None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        head = scope["method"] == "HEAD"
        if head:  # routed, checked and answered as GET; counted as HEAD; the body never sent
            scope, send = {**scope, "method": "GET"}, _headers_only(send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        request_id = choose_request_id(headers.get("x-request-id"))
        scope.setdefault("state", {})["request_id"] = request_id
        id_token = logs.request_id_var.set(request_id)
        items_token = ITEMS_LIMIT.set(self.state.settings.max_batch_items)  # a batch's count checked before its items
        # Admission is decided here, once, and deadlines count from here: a request that arrives before a shutdown
        # begins is answered even if SIGTERM lands before its route runs; one that arrives after it is refused (503).
        scope["state"]["context"] = self.state.arrive(request_id, headers.get("x-request-timeout"))
        path = scope.get("path", "")
        measured = path not in UNMEASURED
        metrics = self.state.metrics
        status_holder = {"status": 500}
        start = time.perf_counter()

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status_holder["status"] = message["status"]
                status_holder["started"] = True
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode())]
            await send(message)

        if measured:
            metrics.inflight.inc()
        if path.startswith(OIP_PREFIX) and not headers.get("content-type"):  # Triton's clients send JSON untyped
            headers["content-type"] = "application/json"
            scope["headers"] = [*scope.get("headers", []), (b"content-type", b"application/json")]
        route = _route_path(scope, self.routes)  # before the route runs: a refusal here is counted under it too
        try:
            scope["state"]["routed"] = route is not None
            refused = self._refusal(scope, headers, path)
            if refused is None and scope["method"] in BODY_METHODS and scope["state"]["routed"]:
                receive, refused = await self._buffered(headers, receive, path.startswith(OIP_PREFIX))
            if refused is not None:  # before the route runs: nothing recorded, nothing counted, no latency
                status, type_, message, extra, *field = refused
                status_holder["early"] = True
                status_holder["status"] = status
                if type_ is None:  # the client went away while sending: nobody to answer
                    return None
                return await self._reply(send, status, type_, message, request_id, extra, path, *field)
            try:
                await self.app(scope, receive, send_wrapper)
            except Exception:  # logged here, while the request id is still on every log line, and answered 500
                log.exception("unhandled error on %s %s", scope["method"], path)
                status_holder["status"] = 500
                if not status_holder.get("started"):
                    await self._reply(send, 500, "internal_error", "internal error; see the service log", request_id,
                                      path=path)
        finally:
            seconds = time.perf_counter() - start
            template = getattr(scope.get("route"), "path", None) or (
                route if route not in (None, NOT_MOUNTED) else "unmatched")
            method = "HEAD" if head else scope["method"] if scope["method"] in METHODS else "other"
            if measured:
                metrics.request_done(template, method, status_holder["status"], seconds,
                                     timed=not status_holder.get("early"))
            context = scope["state"].get("context")
            adapter = scope["state"].get("adapter") or (context.adapter if context is not None else None)
            logs.access(method, template, status_holder["status"], seconds, adapter, request_id, probe=not measured)
            logs.request_id_var.reset(id_token)
            ITEMS_LIMIT.reset(items_token)


def _route_path(scope, routes: list | None) -> str | None:
    """The path template of the route of ``routes`` that takes this path and method (``/v2/models/{model}/infer``),
    or None when none does (the router answers 404, or 405 with Allow): the body checks are for routed requests.
    NOT_MOUNTED without ``routes`` (unit tests): every body is checked."""
    if routes is None:
        return NOT_MOUNTED
    return next((route.path for route in routes if route.matches(scope)[0] == Match.FULL), None)


async def _read_body(receive, limit: int) -> bytes | object | None:
    """The whole request body; None once it exceeds ``limit`` bytes; CLIENT_GONE on a disconnect."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return CLIENT_GONE
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _headers_only(send):
    """A send that passes the response's start (its Content-Length that of the GET) and empties its body."""
    async def sent(message):
        if message["type"] == "http.response.body":
            message = {**message, "body": b""}
        await send(message)

    return sent


def _replay(body: bytes, receive):
    """A receive callable that gives ``body`` once, then defers to the real one (disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed
