"""The service is a door over one engine: a caller of the engine's Python door on another thread, while the service
runs, is scheduled by the same scheduler, answered as HTTP clients are, and counted by the service's hooks."""

from ibedl.engine.engine import Engine
from tests.http_json import ok_json

Q = {"question": "Which is sun?", "options": ["sun", "moon", "tree"]}


def test_the_engine_under_the_service_answers_other_threads(make_client):
    with make_client() as c:
        state = c.app.state.service
        assert isinstance(state.engine, Engine) and state.engine.ready
        watched = ok_json(c.get("/v1/drift"))["options"]  # the count drift watches (per-count calibration: its main)
        q = {**Q, "options": ["sun", "moon", "tree", "fish", "bird"][:watched or 3], "id": "x"}
        (direct,) = state.engine.predict([q])  # this thread is not the service's event loop
        http = ok_json(c.post("/predict", json=q))
        assert direct.model_dump() == http
        metrics, drift = c.get("/metrics").text, ok_json(c.get("/v1/drift"))
    # both answers went through the service's answer hook: its metrics and drift window count them
    assert 'ibedl_answers_total{adapter="tiny"} 2.0' in metrics
    assert drift["window"] == 2


def test_feedback_and_guarantees_are_the_engines(make_client, tmp_path):
    with make_client(feedback_key="test-feedback-key", feedback_db=tmp_path / "f.sqlite") as c:
        state = c.app.state.service
        answer = ok_json(c.post("/predict", json=Q))
        response = state.engine.record_feedback([{"receipt": answer["receipt"], "label": "A"}])
        assert response.recorded == 1
        http, direct = ok_json(c.get("/v1/guarantees")), state.engine.guarantees().model_dump()
    assert http == direct and direct["guarantees"]
