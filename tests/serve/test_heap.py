"""The service's heap out of the cyclic garbage collector's way (ibedl/serve/heap.py): frozen once ready, collected
whole and frozen again after a backend switch once the requests that could hold the old trunk are over."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from ibedl.serve.heap import HeapFreezer


class Cycle:
    """An object reachable from itself: once nothing else holds it, only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def unfrozen():
    """Leaves the test process's heap unfrozen however the test ends."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def generations_hold(obj) -> bool:
    """Whether ``obj`` is in one of the collector's generations (a frozen object is in none: never scanned)."""
    return any(o is obj for o in gc.get_objects())


def test_a_ready_service_has_collected_and_frozen_what_its_start_made(make_client, unfrozen):
    garbage = weakref.ref(Cycle())
    with make_client(gc_freeze=True) as client:
        state = client.app.state.service
        assert gc.get_freeze_count() > 0 and garbage() is None
        assert not generations_hold(state) and not generations_hold(state.engine)  # out of every collection
        assert client.post("/predict", json={"question": "Q?", "options": ["a", "b"]}).status_code == 200


def test_without_gc_freeze_nothing_is_frozen(make_client, unfrozen):
    with make_client(gc_freeze=False) as client:
        assert gc.get_freeze_count() == 0 and generations_hold(client.app.state.service)


def test_a_switch_collects_the_frozen_heap_once_its_requests_are_over(unfrozen):
    """An old trunk frozen at start and reachable only through cycles would never be freed: ``settle_s`` after the
    switch (the requests' deadline) the heap is collected whole, and what survives frozen again."""

    async def scenario():
        freezer = HeapFreezer(settle_s=0.05)
        old_trunk = Cycle()
        old = weakref.ref(old_trunk)
        freezer.readiness(True)
        assert not generations_hold(old_trunk)  # frozen with the start's objects
        del old_trunk
        gc.collect()
        assert old() is not None  # a frozen cycle outlives every collection
        new_trunk = Cycle()
        freezer.refrozen.clear()
        freezer.switched("default", "torch", "openvino-fp32")
        await asyncio.wait_for(freezer.refrozen.wait(), 30)
        assert old() is None and not generations_hold(new_trunk)

    asyncio.run(scenario())


def test_the_refreeze_waits_for_the_requests_and_a_drain_cancels_it(unfrozen):
    async def scenario():
        freezer = HeapFreezer(settle_s=3600)
        freezer.readiness(True)
        freezer.refrozen.clear()
        later = Cycle()
        freezer.switched("default", "torch", "openvino-fp32")
        for _ in range(10):
            await asyncio.sleep(0)
        assert not freezer.refrozen.is_set() and generations_hold(later)  # a request may still hold the old trunk
        assert freezer.pending
        freezer.readiness(False)  # draining: nothing left to do later
        assert not freezer.pending and not freezer.refrozen.is_set()

    asyncio.run(scenario())


def test_a_negative_settle_time_is_refused():
    with pytest.raises(ValueError, match="settle_s must be >= 0, got -1"):
        HeapFreezer(-1)
