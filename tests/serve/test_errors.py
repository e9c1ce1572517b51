"""The one mapping from engine errors to HTTP: every engine error type has its status, and the handler answers
the error body with ``Retry-After`` when the error says when to retry."""

import json

import pytest

from ibedl.engine import errors
from ibedl.serve.errors import STATUS, engine_error_response, status_of
from tests.engine.test_errors import all_errors


@pytest.mark.parametrize("cls", all_errors()[1:], ids=lambda c: c.__name__)
def test_every_engine_error_type_has_a_status(cls):
    assert cls.type in STATUS


@pytest.mark.parametrize(("error", "status"), [
    (errors.InvalidRequest("bad", "options"), 422), (errors.UnknownAdapter("no adapter", "adapter"), 422),
    (errors.TooLarge("long", "question"), 413), (errors.ModelError("nan"), 500), (errors.NotReady("loading"), 503),
    (errors.Overloaded("busy"), 503), (errors.ShuttingDown("bye"), 503), (errors.Timeout("late"), 504),
    (errors.Cancelled("gone"), 499), (errors.EngineError("a bug"), 500),
])
def test_statuses(error, status):
    assert status_of(error) == status


def test_the_handler_answers_the_error_body_and_retry_after():
    response = engine_error_response(errors.Overloaded("busy", retry_after=2.5))
    assert response.status_code == 503 and response.headers["Retry-After"] == "3"
    assert json.loads(response.body) == {"error": {"type": "overloaded", "field": None,
                                                   "message": "busy; retry after the Retry-After seconds"}}
    response = engine_error_response(errors.TooLarge("long", "items.0.question"))
    assert response.status_code == 413 and "Retry-After" not in response.headers
    assert json.loads(response.body)["error"] == {"type": "too_large", "message": "long", "field": "items.0.question"}


def test_a_503_is_always_a_refusal_the_model_never_saw():
    # The gateway retries a 503 on another replica (deploy/nginx/nginx.conf): every engine error answered 503 must be
    # one raised before the model ran. model_error (the model ran and gave NaN) is a 500. store_unavailable is a label
    # the feedback store did not take in time: sent again it is recorded once (a duplicate if the first got through).
    assert sorted(t for t, code in STATUS.items() if code == 503) == ["not_ready", "overloaded", "shutting_down",
                                                                      "store_unavailable"]


@pytest.mark.parametrize("cls", all_errors()[1:], ids=lambda c: c.__name__)
def test_every_engine_error_type_has_a_grpc_status(cls):
    from ibedl.serve.grpc_door import CODES

    assert cls.type in CODES or cls.type in ("feedback_disabled", "invalid_receipt", "receipt_expired",
                                             "adapter_not_served", "label_conflict", "too_many_labels",
                                             "store_unavailable")  # labels: no gRPC call takes them


def oip_error(r, status: int) -> str:
    """The Open Inference Protocol's error body of ``r``, after checking its status and shape."""
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"} and isinstance(r.json()["error"], str), r.text
    return r.json()["error"]


def test_every_status_under_v2_has_the_protocols_body_and_v1_keeps_its_own(make_client, monkeypatch):
    from ibedl.serve import oip

    with make_client(max_body_bytes=2048) as c:
        assert oip_error(c.get("/v2/nothing/here"), 404).startswith("not_found: ")
        assert oip_error(c.delete("/v2/models/tiny/infer"), 405).startswith("method_not_allowed: ")
        assert oip_error(c.post("/v2/models/tiny/infer", content=b"x" * 4096,
                                headers={"content-type": "application/json"}), 413).startswith("too_large: ")
        assert oip_error(c.post("/v2/models/tiny/infer", content=b"{not json"), 422).startswith("invalid_request: ")
        assert oip_error(c.get("/v2/models/absent"), 404).startswith("invalid_request: no adapter 'absent'")

        def broken(*args, **kwargs):
            raise RuntimeError("a bug")

        monkeypatch.setattr(oip, "to_items", broken)
        body = {"inputs": [{"name": "question", "shape": [1], "datatype": "BYTES", "data": ["q"]}]}
        assert oip_error(c.post("/v2/models/tiny/infer", json=body), 500) == \
            "internal_error: internal error; see the service log"
        for r, status in ((c.get("/v1/nothing"), 404), (c.delete("/predict"), 405)):
            assert r.status_code == status and set(r.json()["error"]) == {"type", "message", "field"}
