"""Service logs: JSON lines (IBEDL_LOG_FORMAT=json), one access line per request, the request id on every
record written while serving it, and the settings listed by ``python -m ibedl.serve --help``."""

import contextlib
import dataclasses
import io
import json
import logging

import pytest

from ibedl.serve import logs
from ibedl.serve.__main__ import main
from ibedl.serve.settings import Settings

Q = {"question": "Which is sun?", "options": ["sun", "moon", "tree"]}


@contextlib.contextmanager
def json_log():
    """The service's JSON handler (as ``logs.configure`` builds it) on the root logger, writing to a buffer."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(logs.RequestIdFilter())
    handler.setFormatter(logs.JsonFormatter())
    root, level = logging.getLogger(), logging.getLogger().level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield out
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def records(out: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in out.getvalue().splitlines()]  # every line is one JSON object


def nan_loader(settings):
    """The tiny model, but questions named "break" get NaN probabilities (the service logs an error)."""
    from tests.serve.conftest import load_predictor

    predictor = load_predictor(settings)
    original = predictor.predict

    def predict(questions, truncate_context=True):
        return [dataclasses.replace(p, probs=[float("nan")] * len(p.probs)) if q.question == "break" else p
                for q, p in zip(questions, original(questions, truncate_context), strict=True)]

    predictor.predict = predict
    return predictor


def test_access_line_and_request_id_on_every_line(make_client):
    with make_client(loader=nan_loader) as c, json_log() as out:
        assert c.post("/predict", json=Q, headers={"X-Request-Id": "req-ok"}).status_code == 200
        assert c.post("/predict", json={**Q, "question": "break"},
                      headers={"X-Request-Id": "req-bad"}).status_code == 500
        assert c.post("/predict", json={**Q, "adapter": "nope"}).status_code == 422
        c.get("/health/ready")  # a probe: DEBUG, not in an INFO log
    lines = records(out)
    access = [r for r in lines if r["logger"] == "ibedl.serve.access"]
    assert [(r["method"], r["route"], r["status"]) for r in access] == [
        ("POST", "/predict", 200), ("POST", "/predict", 500), ("POST", "/predict", 422)]
    ok, bad, unknown = access
    assert ok["request_id"] == "req-ok" and ok["adapter"] == "tiny" and ok["latency_ms"] > 0
    assert ok["level"] == "info" and ok["time"].endswith("Z")
    assert unknown["adapter"] is None and len(unknown["request_id"]) == 32  # a generated id
    # the error written while serving req-bad carries its id without the code passing it
    (error,) = [r for r in lines if r["level"] == "error"]
    assert "non-finite" in error["message"] and error["request_id"] == "req-bad"
    assert bad["request_id"] == "req-bad" and bad["adapter"] == "tiny"  # a refused or failed request names it too


def test_an_unhandled_error_is_a_500_with_its_request_id_in_the_response_and_the_log(make_client):
    with make_client() as c, json_log() as out:
        state = c.app.state.service
        runtime = next(iter(state.engine.runtimes.values()))
        original = runtime.calibration
        runtime.calibration = None  # building the answer now fails: a bug, not a client error
        try:
            r = c.post("/predict", json=Q, headers={"X-Request-Id": "req-bug"})
        finally:
            runtime.calibration = original
    assert r.status_code == 500 and r.headers["x-request-id"] == "req-bug"
    assert r.json()["error"]["type"] == "internal_error" and "Traceback" not in r.text
    errors = [x for x in records(out) if x["level"] == "error"]
    assert errors and all(x["request_id"] == "req-bug" for x in errors)
    assert "unhandled error on POST /predict" in errors[0]["message"]


def test_text_format_has_the_request_id():
    record = logging.LogRecord("ibedl.serve", logging.INFO, __file__, 1, "hello %s", ("world",), None)
    token = logs.request_id_var.set("abc")
    try:
        logs.RequestIdFilter().filter(record)
    finally:
        logs.request_id_var.reset(token)
    assert logging.Formatter(logs.TEXT_FORMAT).format(record).endswith("INFO ibedl.serve [abc]: hello world")


def test_log_format_is_checked():
    with pytest.raises(ValueError, match="log_format must be json or text, got 'xml'"):
        Settings(log_format="xml")


def test_help_lists_every_setting(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    missing = [name for name in Settings.model_fields if f"IBEDL_{name.upper()} (default" not in text]
    assert not missing
    assert "IBEDL_MAX_BATCH_SIZE (default 16)" in text and "IBEDL_ARTIFACTS (default unset)" in text
