"""Service test fixtures: an app factory on the tiny trained artifact (tests/conftest.py) that waits until ready."""

from __future__ import annotations

import time
from contextlib import contextmanager

import pytest
from fastapi.testclient import TestClient

from ibedl.engine.runtime import load_predictors
from ibedl.serve.app import create_app
from ibedl.serve.settings import Settings


def load_predictor(settings):
    """The predictor of the one adapter of ``settings`` (the loaders below wrap it to slow or break the model)."""
    predictors = load_predictors(settings)
    assert len(predictors) == 1, f"load_predictor loads one adapter; the settings name {len(predictors)}"
    return predictors[0]


@contextmanager
def uvicorn_server(app, host: str = "127.0.0.1"):
    """``app`` on a real uvicorn in a thread, on a free port of ``host``; yields its URL once ready, stops it after.
    The server takes the socket this bound (no other process can take the port between the pick and the bind, as
    under pytest-xdist's workers). The service knows its server, as ``python -m ibedl.serve`` tells it: setting
    ``should_exit`` (what uvicorn's SIGTERM handler does) drains it."""
    import threading

    import httpx
    import uvicorn

    from benchmarks.service_process import bound_socket

    sock = bound_socket(host)
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    app.state.service.server = srv
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://{host}:{port}"
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                if httpx.get(url + "/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not get ready"
            time.sleep(0.05)
        yield url
    finally:
        srv.should_exit = True
        thread.join(30)
        sock.close()


def wait_ready(client: TestClient, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = client.get("/health/ready")
        if r.status_code == 200:
            return
        if r.json().get("status") == "failed":
            raise AssertionError(f"service failed to load: {r.json()}")
        time.sleep(0.05)
    raise AssertionError("service not ready in time")


def wait_status(client: TestClient, status: str, timeout: float = 30.0) -> dict:
    """The readiness body once it reports ``status`` (loading ends in ready or failed)."""
    deadline = time.monotonic() + timeout
    body = None
    while time.monotonic() < deadline:
        body = client.get("/health/ready").json()
        if body["status"] == status:
            return body
        time.sleep(0.05)
    raise AssertionError(f"the service never reported {status}: {body}")


def load_error(caplog, body: dict) -> str:
    """The text of the exception that failed the load, from the service log, after checking that the readiness
    ``body`` names its type alone (clients never see an exception's text: paths, hashes, settings)."""
    records = [r for r in caplog.records if r.getMessage() == "loading the adapter failed" and r.exc_info]
    assert len(records) == 1, [r.getMessage() for r in caplog.records]
    kind, error = records[0].exc_info[:2]
    assert body["status"] == "failed"
    assert body["reason"] == (f"the adapter failed to load ({kind.__name__}); the service log has the reason "
                              "(the line 'loading the adapter failed')")
    return f"{kind.__name__}: {error}"


@pytest.fixture
def make_client(tiny_artifact):
    @contextmanager
    def factory(loader=None, ready=True, **overrides):
        served = {} if "artifacts" in overrides else {"artifact": tiny_artifact}  # IBEDL_ARTIFACTS replaces it
        settings = Settings(**{**served, "drift_bootstrap": 100, "max_tokens": 96, **overrides})
        app = create_app(settings, loader=loader)
        with TestClient(app, raise_server_exceptions=False) as client:
            if ready:
                wait_ready(client)
            yield client

    return factory


@pytest.fixture
def uncalibrated_artifact(tiny_artifact, tmp_path):
    """A copy of the tiny artifact as an adapter never calibrated for conformal sets (an empty section)."""
    import shutil

    from ibedl.core.artifact import read_manifest, write_manifest

    art = tmp_path / "uncalibrated"
    shutil.copytree(tiny_artifact, art)
    manifest = read_manifest(art)
    manifest.conformal = {}
    write_manifest(art, manifest)
    return art


@pytest.fixture
def client(make_client):
    with make_client() as c:
        yield c


def slow_loader(delay: float):
    """A loader whose predictor sleeps ``delay`` seconds per batch (to fill queues and batch requests)."""

    def load(settings):
        predictor = load_predictor(settings)
        original = predictor.predict

        def predict(questions, truncate_context=True):
            time.sleep(delay)
            return original(questions, truncate_context)

        predictor.predict = predict
        return predictor

    return load


def per_token_loader(seconds_per_token: float):
    """A loader whose predictor sleeps ``seconds_per_token`` per prompt token of each batch: a model whose time
    is what the admission estimate (ibedl/engine/capacity.py) assumes."""

    def load(settings):
        from ibedl.core.predictor import count_prompt_tokens

        predictor = load_predictor(settings)
        original = predictor.predict

        def predict(questions, truncate_context=True):
            tokens = sum(min(count_prompt_tokens(predictor.tokenizer, predictor.template, q), predictor.max_tokens)
                         for q in questions)
            time.sleep(seconds_per_token * tokens)
            return original(questions, truncate_context)

        predictor.predict = predict
        return predictor

    return load
