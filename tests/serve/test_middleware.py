"""RequestGuard on its own, driven as an ASGI app with hand-made receive/send (no HTTP server)."""

import asyncio
from types import SimpleNamespace

from ibedl.engine.engine import Engine
from ibedl.serve.middleware import RequestGuard
from ibedl.serve.observer import ServiceObserver
from ibedl.serve.settings import Settings


def guard(expected_wait_s: float = 0.0, **settings):
    """The middleware in front of an app that answers 200 {}, with a ready engine (no model) whose scheduler
    expects ``expected_wait_s`` seconds of wait for the smallest request."""
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    settings = Settings(**settings)
    observer = ServiceObserver(settings)
    engine = Engine(settings, observers=[observer])
    engine.status, engine.batcher = "ready", SimpleNamespace(expected_wait=lambda tokens: expected_wait_s)
    state = SimpleNamespace(settings=settings, metrics=observer.metrics, engine=engine, arrive=engine.arrive)
    return RequestGuard(app, state), reached, state


def call(mw, receive, method="POST", path="/predict"):
    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path,
             "headers": [(b"content-type", b"application/json")]}
    asyncio.run(mw(scope, receive, send))
    return sent


def test_a_body_that_stops_arriving_is_answered_408_and_never_reaches_the_route():
    mw, reached, _ = guard(body_timeout_s=0.2)

    async def receive():  # half a body, then silence
        if not hasattr(receive, "sent"):
            receive.sent = True
            return {"type": "http.request", "body": b'{"question": ', "more_body": True}
        await asyncio.sleep(3600)

    sent = call(mw, receive)
    assert sent[0]["status"] == 408 and b"did not arrive within 0.2 s" in sent[1]["body"]
    assert (b"connection", b"close") in sent[0]["headers"]
    assert reached == []


def test_a_whole_body_reaches_the_route_once():
    mw, reached, state = guard(body_timeout_s=0.2)
    chunks = [{"type": "http.request", "body": b'{"a":', "more_body": True},
              {"type": "http.request", "body": b" 1}", "more_body": False}]

    async def receive():
        return chunks.pop(0)

    sent = call(mw, receive)
    assert sent[0]["status"] == 200 and reached == ["/predict"]
    assert 'status="200"' in _metrics(state)


def test_unknown_methods_share_one_label_value():
    mw, _, state = guard()

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    for method in ("BREW", "FROB"):
        call(mw, receive, method=method, path="/v1/models")
    text = _metrics(state)
    assert 'method="other"' in text and "BREW" not in text and "FROB" not in text


def _metrics(state) -> str:
    from prometheus_client import generate_latest

    return generate_latest(state.metrics.registry).decode()


def test_when_nothing_could_be_answered_in_time_the_body_is_never_read():
    # the default request timeout is 30 s and the admission margin 1.5: 1.5 x 21.7 s is 2.55 s past the deadline
    mw, reached, state = guard(expected_wait_s=21.7)

    async def receive():
        raise AssertionError("the body was read")

    sent = call(mw, receive)
    assert sent[0]["status"] == 503 and (b"retry-after", b"3") in sent[0]["headers"]
    assert b'"overloaded"' in sent[1]["body"] and reached == []
    assert 'ibedl_rejected_total{reason="capacity"} 1.0' in _metrics(state)
