"""A service's heap out of the cyclic garbage collector's way (ibedl/engine/heap.py): frozen when the engine is ready,
collected whole and frozen again after a backend switch once the requests that could hold the old trunk are over."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from ibedl.engine.heap import HeapFreezer
from tests.conftest import Cycle, generations_hold


def test_ready_collects_the_heap_and_freezes_what_survives(unfrozen):
    from ibedl.core.memory_limit import collect_garbage

    garbage, kept = Cycle(), Cycle()
    dead = weakref.ref(garbage)
    collect_garbage(freeze=True)  # frozen while alive (an earlier freeze): no plain collection frees it now
    del garbage
    gc.collect()
    assert dead() is not None
    freezer = HeapFreezer(settle_s=30)
    freezer.readiness(True)
    assert dead() is None and not generations_hold(kept) and freezer.frozen == gc.get_freeze_count() > 0


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
