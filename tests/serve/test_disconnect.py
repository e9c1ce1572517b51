"""A client that goes away takes its queued question with it: a real uvicorn server in this process (the tiny
artifact behind a slow predictor), since only a real connection can be closed mid-request."""

import threading
import time

import httpx
import pytest

from ibedl.serve.app import create_app
from ibedl.serve.settings import Settings
from tests.serve.conftest import slow_loader, uvicorn_server

Q = {"question": "Which is sun?", "options": ["sun", "moon", "tree", "fish"]}


def sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


@pytest.fixture
def server(tiny_artifact):
    settings = Settings(artifact=tiny_artifact, drift_bootstrap=100, max_tokens=96, max_batch_size=1)
    with uvicorn_server(create_app(settings, loader=slow_loader(2.0))) as url:
        yield url


def test_a_gone_clients_question_never_reaches_the_model(server):
    with httpx.Client(timeout=30) as client:
        first = threading.Thread(target=lambda: client.post(server + "/predict", json=Q))
        first.start()  # holds the model for 2 s
        deadline = time.monotonic() + 10
        while sample(client.get(server + "/metrics").text, "ibedl_inflight_requests") < 1:
            assert time.monotonic() < deadline, "the first request never arrived"
            time.sleep(0.01)
        with pytest.raises(httpx.ReadTimeout):  # queued behind it; the client gives up and closes
            httpx.post(server + "/predict", json={**Q, "question": "Which is moon?"}, timeout=0.2)
        first.join(30)
        deadline = time.monotonic() + 10
        while sample(client.get(server + "/metrics").text, 'ibedl_rejected_total{reason="client_gone"}') < 1:
            assert time.monotonic() < deadline, "the disconnect was never noticed"
            time.sleep(0.05)
        assert client.post(server + "/predict", json=Q).status_code == 200
        text = client.get(server + "/metrics").text
    assert sample(text, "ibedl_batch_size_sum") == 2  # the first and the last question: not the abandoned one
    assert 'ibedl_requests_total{method="POST",route="/predict",status="499"} 1.0' in text
