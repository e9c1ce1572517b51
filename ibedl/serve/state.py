"""The HTTP binding of one engine (``app.state.service``): the engine (``ibedl.engine.engine.Engine``: adapters,
scheduler, lifecycle, feedback), the observer that keeps the service's metrics and drift monitors
(``ibedl.serve.observer``), the gRPC door beside the HTTP one, and what only a process has: SIGTERM from uvicorn and
SIGHUP. Routes get it through ``State``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Annotated

from fastapi import Depends, Request

from ibedl.engine.context import TIMEOUT_HEADER, RequestContext
from ibedl.engine.engine import Engine, Loader
from ibedl.engine.heap import HeapFreezer
from ibedl.serve.observer import ServiceObserver
from ibedl.serve.settings import Settings

log = logging.getLogger("ibedl.serve")



class ServiceState:
    """One engine served over HTTP (and gRPC): its settings, engine, observer and the process's signals."""

    def __init__(self, settings: Settings, loader: Loader | None = None) -> None:
        self.settings = settings
        self.observer = ServiceObserver(settings)
        self.metrics = self.observer.metrics
        observers = [self.observer, *([HeapFreezer(settings.request_timeout_s)] if settings.gc_freeze else [])]
        self.engine = Engine(settings, loader, observers=observers)  # all the settings: the loader reads them
        self.server = None  # uvicorn.Server when run by ibedl.serve.__main__, to notice SIGTERM
        self.grpc = None  # ibedl.serve.grpc_door.GrpcDoor while the gRPC port is open
        self._watcher: asyncio.Task | None = None
        self._hangup = None  # the signal whose handler this state installed (SIGHUP), to remove at shutdown

    async def load(self) -> None:
        """Open the gRPC port (its health answers while loading), load the engine, and drain on uvicorn's SIGTERM
        at once, not at the next probe; SIGHUP makes the engine look at the served manifests now."""
        hangup = getattr(signal, "SIGHUP", None)
        if hangup is not None:  # its default action would end the process
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # only the main thread's loop
                asyncio.get_running_loop().add_signal_handler(hangup, self.engine.poke)
                self._hangup = hangup
        self._watcher = asyncio.get_running_loop().create_task(self._watch_shutdown(), name="shutdown-watcher")
        if self.settings.grpc:
            try:
                from ibedl.serve.grpc_door import GrpcDoor
            except Exception as e:  # noqa: BLE001  (tritonclient raises RuntimeError, not ImportError, without grpc)
                log.exception("the gRPC door cannot be imported")
                self.engine.fail(f"the gRPC door cannot be imported ({type(e).__name__}; the log has the message): "
                                 "install the serve extra (grpcio, tritonclient[grpc]), or set IBEDL_GRPC=false to "
                                 "serve HTTP alone")
                return
            self.grpc = GrpcDoor(self.engine, self.settings, self.metrics, self.notice_shutdown)
            try:
                await self.grpc.start()
            except Exception as e:  # a port in use: readiness says so (the model is not loaded for nothing)
                log.exception("opening the gRPC port failed")
                self.grpc = None
                self.engine.fail(f"the gRPC port {self.settings.host}:{self.settings.grpc_port} cannot be opened "
                                 f"({type(e).__name__}): set IBEDL_GRPC_PORT to a free port, or IBEDL_GRPC=false")
                return
        await self.engine.open()

    def notice_shutdown(self) -> None:
        """Drain once uvicorn has SIGTERM (``server.should_exit``): both doors refuse what arrives from then on and
        answer what was admitted. Called on every arrival and probe (a request that reaches the process on a kept-alive
        connection right after SIGTERM is refused, so the gateway retries it elsewhere) and by the watcher."""
        if self.server is not None and getattr(self.server, "should_exit", False):
            self.engine.drain()

    def arrive(self, request_id: str | None, timeout: str | float | None) -> RequestContext:
        """The engine's context of a request arriving now, SIGTERM noticed first."""
        self.notice_shutdown()
        return self.engine.arrive(request_id, timeout)

    async def _watch_shutdown(self) -> None:
        """Drain as soon as uvicorn has SIGTERM, not at the next arrival."""
        while self.engine.health()[0] not in ("draining", "stopped"):
            self.notice_shutdown()
            await asyncio.sleep(0.05)

    async def shutdown(self) -> None:
        self.engine.drain()
        if self._watcher is not None:
            self._watcher.cancel()
        if self._hangup is not None:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                asyncio.get_running_loop().remove_signal_handler(self._hangup)
            self._hangup = None
        if self.grpc is not None:
            await self.grpc.stop(self.settings.shutdown_grace_s)
        await self.engine.stop()

    def context(self, request: Request) -> RequestContext:
        """The engine's context of ``request``, made by RequestGuard on arrival (one made now for a request that did
        not pass it: unit tests)."""
        scope = request.scope.setdefault("state", {})
        if "context" not in scope:
            scope["context"] = self.arrive(scope.get("request_id"), request.headers.get(TIMEOUT_HEADER))
        context = scope["context"]
        context.gone = lambda: _disconnected(request)
        return context

    def require_ready(self, request: Request) -> None:
        """Refuse (503 not_ready + Retry-After) unless the engine can answer this request."""
        self.engine.require(self.context(request))

    def health(self) -> tuple[int, dict]:
        self.notice_shutdown()
        status, reason = self.engine.health()
        return (200, {"status": status}) if status == "ready" else (503, {"status": status, "reason": reason})


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def get_state(request: Request) -> ServiceState:
    """The service's state, for routes (``State``). A coroutine: FastAPI awaits it on the event loop, where it would
    run a plain function in a worker thread, a hop per request (tests/serve/test_app.py)."""
    return request.app.state.service


State = Annotated[ServiceState, Depends(get_state)]
__all__ = ["ServiceState", "State", "Loader"]
