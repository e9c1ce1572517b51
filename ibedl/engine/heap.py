"""A service process's heap out of Python's cyclic garbage collector's way. A loaded service holds about half a
million objects the collector tracks (torch, transformers, pydantic's schemas, the adapters), nearly all made at start
and kept for the process's life. Each full collection walks them all, about 0.25 s on the event loop of a 2-core
Xeon, and the answers' short-lived objects set one off every 800 or so requests: those pauses were the service's p99
(``benchmarks.service_bound``). Once the engine is ready, what the start made is moved out of the collector's way
(``gc.freeze``: collected first, then never walked again; still freed when its last reference goes). What drops a
model collects the frozen objects too (``ibedl.core.memory_limit.collect_garbage``). A backend switch replaces an
adapter's trunk: once every request that could hold the old one has ended (``request_timeout_s`` later), the heap is
collected whole (the old trunk freed, were it reachable only through cycles) and frozen anew.

Attached by the service to its own engine (``ibedl.serve.state``, ``IBEDL_GC_FREEZE``): the Python API never freezes
its caller's heap."""

from __future__ import annotations

import asyncio
import gc
import logging
import time

from ibedl.core.memory_limit import collect_garbage
from ibedl.engine.observer import Observer

log = logging.getLogger("ibedl.engine")


class HeapFreezer(Observer):
    """Freezes the heap when the engine becomes ready, and again ``settle_s`` seconds after a backend switch (the
    requests' longest life: ``request_timeout_s``); a drain cancels a refreeze not yet due. Each freeze takes the
    event loop for a whole collection (0.2-0.4 s), once at start and once a switch: not quick, as an observer
    should be, and rare. ``frozen`` is the objects the last freeze froze; ``refrozen`` is set after each freeze."""

    def __init__(self, settle_s: float) -> None:
        if not settle_s >= 0:
            raise ValueError(f"settle_s must be >= 0, got {settle_s}")
        self.settle_s = settle_s
        self.frozen = 0
        self.refrozen = asyncio.Event()
        self._pending: asyncio.TimerHandle | None = None

    @property
    def pending(self) -> bool:
        """Whether a refreeze is due (after a switch)."""
        return self._pending is not None

    def readiness(self, ready: bool) -> None:
        self._cancel()
        if ready:
            self._freeze()

    def switched(self, adapter: str, old: str, new: str) -> None:
        """Called on the engine's event loop (``Observer.switched``), where the refreeze is timed."""
        self._cancel()
        self._pending = asyncio.get_running_loop().call_later(self.settle_s, self._freeze)

    def _freeze(self) -> None:
        """Collect the whole heap (what was frozen before too), then freeze what survives."""
        self._pending = None
        start = time.perf_counter()
        collect_garbage(freeze=True)
        self.frozen = gc.get_freeze_count()
        log.info("froze the %d objects the garbage collector tracks out of its scans (%.0f ms)", self.frozen,
                 1e3 * (time.perf_counter() - start))
        self.refrozen.set()

    def _cancel(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
