"""How the service meets the network: whether its settings may bind the address they name (a non-loopback
address needs a token, or an explicit IBEDL_ALLOW_ANONYMOUS), and the uvicorn configuration that bounds
connections (IBEDL_MAX_CONNECTIONS) and the time to send a request's headers (IBEDL_HEADER_TIMEOUT_S)."""

from __future__ import annotations

import asyncio
import logging

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ibedl.engine.feedback_kinds import STORE_SETTINGS, persistent
from ibedl.serve.auth import PROBES
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


class ServiceH11(H11Protocol):
    """uvicorn's h11 protocol with three changes:

    - a connection is closed when no request's headers are complete ``header_timeout_s`` after it opened or after
      its last response completed (uvicorn itself waits forever for the first request's headers, so a client that
      opens connections and sends nothing would hold them up to IBEDL_MAX_CONNECTIONS; and a client still sending
      the body of a request answered early, a refusal, would hold one with no timer: its data cancels uvicorn's
      keep-alive timer);
    - at shutdown an idle kept-alive connection is not closed at once: a request the peer has just sent on it would
      be reset unread, and the gateway cannot retry a POST it already sent (it answers 502). The next request on it
      is answered (the draining service refuses it with 503, which the gateway retries on another replica) with
      ``Connection: close``; otherwise the peer closes it first (the gateway's pool after 4 s) or a timer does: the
      keep-alive timer (KEEP_ALIVE_S) after a response, the header timer on a connection that never sent a request.
      A response still to start at shutdown says ``Connection: close`` too;
    - the health probes (PROBES) are answered over the connection cap (IBEDL_MAX_CONNECTIONS), where uvicorn answers
      every request 503: a liveness probe failing on a replica busy with many kept-alive connections would have the
      kubelet restart it and move its load onto the others. Every other path still gets the 503."""

    header_timeout_s: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None
    _closing = False

    @property
    def limit_concurrency(self) -> int | None:
        """uvicorn's cap, read once a request's scope is made: None (no cap) for a health probe."""
        scope = getattr(self, "scope", None)
        if scope is not None and scope.get("path") in PROBES:
            return None
        return self._limit_concurrency

    @limit_concurrency.setter
    def limit_concurrency(self, value: int | None) -> None:
        self._limit_concurrency = value

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._answering():  # a request's headers are in: its body has its own timeout
            self._cancel_header_timer()
            if self._closing:
                self._close_after(self.cycle)

    def shutdown(self) -> None:
        self._closing = True
        if not self._answering():
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
        if not self.transport.is_closing() and not self._answering():
            self._arm_header_timer()  # the next request's headers get the same time, whatever of the body still comes

    def _answering(self) -> bool:
        """Whether a request whose headers are in is being answered (a pipelined one may start in
        ``on_response_complete``)."""
        return self.cycle is not None and not self.cycle.response_complete

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
        self._header_timer = None
        if not self._answering() and not self.transport.is_closing():
            log.debug("closing a connection with no request's headers complete %g s after it opened or after its last "
                      "answer", self.header_timeout_s)
            self.transport.close()


def service_protocol(header_timeout_s: float) -> type[ServiceH11]:
    """The service's h11 protocol (ServiceH11) with ``header_timeout_s`` (IBEDL_HEADER_TIMEOUT_S)."""
    if not header_timeout_s > 0:
        raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s}")
    return type("ServiceH11", (ServiceH11,), {"header_timeout_s": float(header_timeout_s)})


def uvicorn_config(app, settings: Settings) -> uvicorn.Config:
    """The uvicorn configuration the service runs ``app`` with."""
    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                          timeout_graceful_shutdown=settings.shutdown_grace_s, access_log=False,
                          log_config=None,  # uvicorn's lines go through the service's handlers (JSON or text)
                          http=service_protocol(settings.header_timeout_s),
                          limit_concurrency=settings.max_connections, timeout_keep_alive=KEEP_ALIVE_S,
                          ws="none")  # no WebSocket route: an upgrade request is answered over HTTP/1.1
