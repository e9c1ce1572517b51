"""The feedback store's own thread. A store that waits (another replica's lock, a slow or unreachable server) holds
only this thread, never the event loop nor the default pool."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ibedl.engine.errors import StoreUnavailable

# A feedback call is at most a connect, the label's write, a read and a checkpoint, each waiting up to
# IBEDL_FEEDBACK_TIMEOUT_S for the store: a request waits this many timeouts for its call, then store_unavailable.
STORE_WAITS = 4


class StoreCalls:
    """Calls to the feedback store, one at a time on its thread, each waited for at most ``STORE_WAITS`` times
    ``timeout_s`` (the store's own wait) unless the caller says otherwise."""

    def __init__(self, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._thread: ThreadPoolExecutor | None = None
        self._closed = False

    def _pool(self) -> ThreadPoolExecutor:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="ibedl-store")
        return self._thread

    async def run(self, fn: Callable, *args, timeout: float | None = None):
        """``fn(*args)`` on the store's thread, waited for at most ``timeout`` seconds (default STORE_WAITS x the
        store's timeout), then StoreUnavailable; the call itself goes on to its end on its thread (a label it
        records counts: sent again, it is a duplicate). StoreUnavailable at once after :meth:`close`."""
        if self._closed:
            raise StoreUnavailable("the feedback store is closed: the engine has stopped")
        call = asyncio.get_running_loop().run_in_executor(self._pool(), fn, *args)
        wait = STORE_WAITS * self.timeout_s if timeout is None else timeout
        try:
            return await asyncio.wait_for(call, wait)
        except asyncio.TimeoutError:
            raise StoreUnavailable(f"the feedback store did not answer within {wait:g} s; retry shortly",
                                   retry_after=max(1, math.ceil(self.timeout_s))) from None

    def close(self, store=None) -> None:
        """Close ``store`` after the calls already queued (at once when none was made), and let the thread end; a
        second close does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._thread is None:  # no call went through here (a Python caller that never recorded a label)
            if store is not None:
                store.close()
            return
        if store is not None:
            self._thread.submit(store.close)
        self._thread.shutdown(wait=False)
        self._thread = None
