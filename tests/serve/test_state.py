"""The service's binding of its engine (ibedl/serve/state.py): the heap freezer attached as IBEDL_GC_FREEZE says."""

from __future__ import annotations

import gc

from ibedl.engine.heap import HeapFreezer
from tests.conftest import generations_hold

Q = {"question": "Which is a planet?", "options": ["Mars", "Moon"]}


def freezers(state) -> list[HeapFreezer]:
    return [o for o in state.engine.observers if isinstance(o, HeapFreezer)]


def test_a_ready_service_has_frozen_what_its_start_made(make_client, unfrozen):
    with make_client(gc_freeze=True, request_timeout_s=12) as client:
        state = client.app.state.service
        (freezer,) = freezers(state)
        assert freezer.settle_s == 12 and not freezer.pending  # a switch's refreeze waits for the requests' deadline
        assert freezer.frozen > 0 and gc.get_freeze_count() > 0  # frozen objects still go by refcount
        assert not generations_hold(state) and not generations_hold(state.engine)  # out of every collection
        assert client.post("/predict", json=Q).status_code == 200


def test_without_gc_freeze_nothing_is_frozen(make_client, unfrozen):
    with make_client(gc_freeze=False) as client:
        assert freezers(client.app.state.service) == [] and gc.get_freeze_count() == 0
        assert generations_hold(client.app.state.service)
