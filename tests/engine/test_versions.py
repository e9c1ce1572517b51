"""The manifest watcher (ibedl.engine.versions.Versions): it reads the feedback store's new labels at each look, ends
once stopped even when the stop's cancel is lost in a store call that had just finished, and says a failing store
once, not at every look."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import types

import pytest

from ibedl.engine.errors import StoreUnavailable
from ibedl.engine.store_calls import StoreCalls
from ibedl.engine.versions import Versions


class Store:
    closed = False

    def close(self) -> None:
        self.closed = True


def engine_with(refresh, interval: float = 0.01):
    settings = types.SimpleNamespace(reload_interval_s=interval, served_artifacts=lambda: [])
    feedback = types.SimpleNamespace(enabled=True, shared=True, refresh=refresh)
    return types.SimpleNamespace(settings=settings, feedback=feedback, store=StoreCalls(5.0))


def test_a_stopped_watcher_reads_the_store_no_more():
    """The loop is busy while a refresh finishes, then stops the watcher and closes the store (Engine.stop's order):
    the watcher ends, and no refresh reaches the closed store."""
    store, started, seen = Store(), threading.Event(), []

    def refresh():
        seen.append(store.closed)
        started.set()

    async def main():
        engine = engine_with(refresh)
        versions = Versions(engine)
        versions.start([])
        watcher = versions._watcher
        await asyncio.get_running_loop().run_in_executor(None, started.wait)
        # on the loop's thread: the refresh and its result's hand-over to the loop are over (the store's one thread
        # takes this no-op after them) before the watcher can resume
        engine.store._pool().submit(lambda: None).result()
        versions.stop()
        engine.store.close(store)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(watcher, 5.0)
        assert watcher.done()

    asyncio.run(main())
    assert seen and not any(seen)


def test_a_closed_store_refuses_calls_at_once():
    calls = StoreCalls(5.0)
    calls.close()

    async def main():
        with pytest.raises(StoreUnavailable, match="the feedback store is closed"):
            await calls.run(lambda: None)

    asyncio.run(main())


def test_a_failing_store_is_said_once_and_its_return_once(caplog):
    """Three failed looks log one warning; the next look that reads logs that the store answers again."""
    outcomes = iter([RuntimeError("down"), RuntimeError("down"), RuntimeError("down"), None])
    done = threading.Event()

    def refresh():
        outcome = next(outcomes, None)
        if outcome is not None:
            raise outcome
        done.set()

    async def main():
        versions = Versions(engine_with(refresh))
        versions.start([])
        await asyncio.get_running_loop().run_in_executor(None, done.wait)
        while versions._store_down:  # the look that read it logs the return once it resumes
            await asyncio.sleep(0)
        versions.stop()

    with caplog.at_level(logging.INFO, logger="ibedl.engine"):
        asyncio.run(main())
    said = [r.getMessage() for r in caplog.records if "feedback:" in r.getMessage()]
    assert len(said) == 2 and "failed" in said[0] and "answers again" in said[1]
