"""How the service meets the network: whether its settings may bind the address they name (a non-loopback
address needs a token, or an explicit IBEDL_ALLOW_ANONYMOUS), and the uvicorn configuration that bounds
connections (IBEDL_MAX_CONNECTIONS) and the time to send a request's headers (IBEDL_HEADER_TIMEOUT_S)."""

from __future__ import annotations

import asyncio
import logging

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ibedl.engine.feedback_kinds import STORE_SETTINGS, persistent
from ibedl.serve.settings import Settings

log = logging.getLogger("ibedl.serve")
KEEP_ALIVE_S = 5  # uvicorn closes a kept-alive connection idle this long; the gateway's upstream pool closes sooner


def refusal(settings: Settings) -> str | None:
    """Why the service must not start with ``settings`` (None: it may): a non-loopback ``host`` without
    IBEDL_API_TOKEN would serve anyone who reaches the port, unless IBEDL_ALLOW_ANONYMOUS says so on purpose."""
    if settings.exposed() and settings.api_token is None and not settings.allow_anonymous:
        return (f"refusing to serve {settings.host}:{settings.port} without a token: every client that reaches this "
                "address could use the API. Set IBEDL_API_TOKEN (e.g. IBEDL_API_TOKEN=$(openssl rand -hex 32)), "
                "bind a loopback address (--host 127.0.0.1), or set IBEDL_ALLOW_ANONYMOUS=true to serve it open "
                "on purpose")
    return None


def log_exposure(settings: Settings) -> None:
    """One line at start saying who may call the API, and one saying who may send labels (feedback on), with a
    warning when a service others reach keeps its labels in memory (each replica would count its own)."""
    where = f"{settings.host}:{settings.port}"
    if settings.api_token is not None:
        log.info("serving %s; every route but the health probes requires the bearer token (IBEDL_API_TOKEN)", where)
    elif settings.exposed():
        log.warning("IBEDL_ALLOW_ANONYMOUS=true: serving %s OPEN, without a token; anyone who reaches this address "
                    "can use the API", where)
    else:
        log.info("serving %s without a token: open to clients on this machine only (loopback)", where)
    if settings.feedback_key is None:
        return
    if not persistent(settings) and settings.exposed():
        log.warning("labelled feedback keeps its labels in this process only (no %s): with several replicas each "
                    "counts its own, and a restart forgets them", STORE_SETTINGS)
    if settings.label_token is not None:
        log.info("labels (POST /v1/feedback) require the labelling credential (IBEDL_LABEL_TOKEN), at most %d per "
                 "%d s", settings.max_labels, settings.label_window_s)
    elif settings.labels_open():
        log.info("labels (POST /v1/feedback) are accepted without a token (loopback, no IBEDL_API_TOKEN)")
    else:
        log.warning("labels (POST /v1/feedback) are refused: set IBEDL_LABEL_TOKEN to accept them")


CLOSE = (b"connection", b"close")
# A request's target, header and trailer lines, at most (bytes): what uvicorn's h11 protocol allowed a request's head
# (h11's max_incomplete_event_size). httptools itself sets no bound: without this a client could send header lines
# until the header timeout, all kept in memory.
MAX_HEAD_BYTES = 16 * 1024


class HeadTooLarge(Exception):
    """A request's target and headers passed MAX_HEAD_BYTES (raised in a parser callback: the parser stops)."""


class UpgradeWithBody(Exception):
    """A request asks to switch protocols and carries a body (raised in a parser callback: the parser stops)."""


class ServiceHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol (its HTTP/1.1 parser in C: the event loop's CPU an answer is 0.86x what uvicorn's
    h11 protocol costs, docs/results.md#service-bound) with these changes:

    - a connection is closed when no request's headers are complete ``header_timeout_s`` after it opened or after
      its last response completed (and again after that request's body ended, if it ended later): uvicorn itself
      waits forever for the first request's headers, so a client that opens connections and sends nothing would
      hold them up to IBEDL_MAX_CONNECTIONS, and a client still sending a body its early response (a refusal)
      did not read would hold one with no timer (any data cancels uvicorn's keep-alive timer);
    - a request whose target, header and trailer lines pass MAX_HEAD_BYTES is answered 431 (or, during its response,
      only closed). httptools hands a header over only once the next one starts, and keeps one that never ends, so
      the lines handed over are counted and so are the reads in which the parser handed over nothing (at most
      MAX_HEAD_BYTES in a row);
    - a request that asks to switch protocols (``Connection: upgrade`` with ``Upgrade``, e.g. h2c) and carries a
      body is answered 400 and closed: httptools ends such a request at its headers and would drop its body or read
      it as the next request (uvicorn#2722). Without a body it is answered as any request, over HTTP/1.1;
    - at shutdown an idle kept-alive connection is not closed at once: a request the peer has just sent on it would
      be reset unread, and the gateway cannot retry a POST it already sent (it answers 502). The next request on it
      is answered (the draining service refuses it with 503, which the gateway retries on another replica) with
      ``Connection: close``; otherwise the peer closes it first (the gateway's pool after 4 s) or a timer does: the
      keep-alive timer (KEEP_ALIVE_S) after a response, the header timer on a connection that never sent a request.
      A response still to start at shutdown says ``Connection: close`` too."""

    header_timeout_s: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None
    _closing = False
    _head_bytes = 0  # of the request being parsed: its target, header and trailer lines handed over so far
    _stalled = 0  # bytes of the reads in a row in which the parser handed nothing over
    _moved = False  # the parser handed something over during this read
    _upgrade_refused = False

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        self._moved = False
        super().data_received(data)
        if self._closing and self.cycle is not None and not self.cycle.response_complete:
            self._close_after(self.cycle)
        if self._moved:
            self._stalled = 0
        elif not self.transport.is_closing():
            self._stalled += len(data)  # one header or trailer line that does not end, held by the parser
            if self._stalled > MAX_HEAD_BYTES:
                self._refuse_head()

    def on_message_begin(self) -> None:
        self._moved, self._head_bytes = True, 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def _count_head(self, size: int) -> None:
        self._moved = True
        self._head_bytes += size
        if self._head_bytes > MAX_HEAD_BYTES:
            raise HeadTooLarge(f"the request's target and headers pass {MAX_HEAD_BYTES} bytes")

    def on_headers_complete(self) -> None:
        self._moved = True
        if self.parser.should_upgrade() and any(
                name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0")
                for name, value in self.headers):
            self._upgrade_refused = True
            raise UpgradeWithBody("a request that asks to switch protocols carries a body")
        super().on_headers_complete()
        self._cancel_header_timer()

    def on_body(self, body: bytes) -> None:
        self._moved = True
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._moved = True
        super().on_message_complete()
        if self.cycle is not None and self.cycle.response_complete and not self.transport.is_closing():
            self._arm_header_timer()  # the body ended past its early response: the next headers get the full time

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request the parser refused: 431 when it was refused for its size, and a 400 that
        says why for a switch of protocols with a body."""
        if self._head_bytes > MAX_HEAD_BYTES:
            return self._refuse_head()
        if self._upgrade_refused:
            self.logger.warning("refused a request that asks to switch protocols and carries a body")
            msg = ("this service speaks HTTP/1.1 only: send the request without Upgrade and Connection: upgrade "
                   "(a request that asks to switch protocols cannot carry a body here)")
        return super().send_400_response(msg)

    def _refuse_head(self) -> None:
        """Answer 431 and close (only close during a response): the request's head passed MAX_HEAD_BYTES."""
        self.logger.warning("refused a request whose target, header and trailer lines pass %d bytes", MAX_HEAD_BYTES)
        if self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete:
            self.transport.close()
            return
        body = f"the request's target and headers pass {MAX_HEAD_BYTES} bytes".encode()
        head = [b"HTTP/1.1 431 Request Header Fields Too Large\r\n"]
        for name, value in self.server_state.default_headers:
            head.append(name + b": " + value + b"\r\n")
        head.append(b"content-type: text/plain; charset=utf-8\r\ncontent-length: " + str(len(body)).encode()
                    + b"\r\nconnection: close\r\n\r\n")
        self.transport.write(b"".join(head) + body)
        self.transport.close()

    def shutdown(self) -> None:
        self._closing = True
        if self.cycle is None or self.cycle.response_complete:
            return  # idle: see above
        self._close_after(self.cycle)

    @staticmethod
    def _close_after(cycle) -> None:
        """The response of ``cycle`` is its connection's last, and says so when it has not started."""
        cycle.keep_alive = False
        if not cycle.response_started and CLOSE not in cycle.default_headers:
            cycle.default_headers = [*cycle.default_headers, CLOSE]

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()  # the next request's headers get the same time; data does not cancel it

    def connection_lost(self, exc) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        """No request's headers came in time: close, unless a request is being answered."""
        self._header_timer = None
        if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
            log.debug("closing a connection that sent no complete request headers in %g s", self.header_timeout_s)
            self.transport.close()


def service_protocol(header_timeout_s: float) -> type[ServiceHttp]:
    """The service's HTTP protocol (ServiceHttp) with ``header_timeout_s`` (IBEDL_HEADER_TIMEOUT_S)."""
    if not header_timeout_s > 0:
        raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s}")
    return type("ServiceHttp", (ServiceHttp,), {"header_timeout_s": float(header_timeout_s)})


def uvicorn_config(app, settings: Settings) -> uvicorn.Config:
    """The uvicorn configuration the service runs ``app`` with."""
    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                          timeout_graceful_shutdown=settings.shutdown_grace_s, access_log=False,
                          log_config=None,  # uvicorn's lines go through the service's handlers (JSON or text)
                          http=service_protocol(settings.header_timeout_s),
                          limit_concurrency=settings.max_connections, timeout_keep_alive=KEEP_ALIVE_S)
