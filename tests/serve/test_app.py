import dataclasses
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ibedl.core.artifact import read_manifest, write_manifest
from tests.http_json import ok_json
from tests.serve.conftest import load_error, per_token_loader, slow_loader, wait_status

Q = {"question": "Which is sun?", "options": ["sun", "moon", "tree", "fish"]}


def check_invariants(body, n):
    letters = [chr(65 + i) for i in range(n)]
    assert list(body["probabilities"]) == letters
    assert sum(body["probabilities"].values()) == pytest.approx(1, abs=1e-5)
    u = body["uncertainty_mass"]
    assert sum(body["belief_masses"].values()) + u == pytest.approx(1, abs=1e-5)
    for k in letters:
        assert body["probabilities"][k] == pytest.approx(body["belief_masses"][k] + u / n, abs=2e-6)
    assert body["confidence"] == max(body["probabilities"].values())
    assert body["prediction"]["letter"] == max(body["probabilities"], key=body["probabilities"].get)


class TestPredict:
    def test_schema_and_invariants(self, client):
        r = client.post("/predict", json={**Q, "id": "q1"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"] == "q1"
        assert set(body) == {"id", "prediction", "probabilities", "belief_masses", "uncertainty_mass", "confidence",
                             "sigma", "ood_score", "prediction_set", "prediction_set_coverage", "prediction_set_score",
                             "abstained", "abstain_reason", "adapter", "adaptive_prediction_set", "receipt",
                             "guarantees"}
        check_invariants(body, 4)
        assert body["prediction"]["text"] == Q["options"][body["prediction"]["index"]]
        assert body["adapter"] == {"name": "tiny", "method": "ib_edl", "version": "1", "backend": "torch",
                                   "calibration": "torch-fp32"}
        assert set(body["sigma"]) == {"A", "B", "C", "D"}
        assert r.headers["x-request-id"]

    def test_an_answer_states_its_guarantees_and_whether_they_hold_for_its_option_count(self, client):
        card = client.get("/v1/models").json()["data"][0]
        counts = card["calibrated_option_counts"]  # tiny_jsonl: 3 to 5 options
        assert counts == [3, 4, 5] and card["conformal"]["delta"] == 0.01
        four = card["abstention"]["by_options"]["4"]  # Q has 4 options: calibrated on its own
        how, gate = four["how"], four["ood_threshold"] > 0
        body = ok_json(client.post("/predict", json=Q))
        assert body["guarantees"] == {
            "holds": True, "reason": None, "since": None, "option_counts": counts,
            "answered_accuracy": how["target_accuracy"] if how["certified"] else None,
            "answered_accuracy_delta": how["delta"] if how["certified"] else None,
            "set_coverage": 0.9, "set_coverage_delta": 0.01,
            "gate_refusal_rate": how["gate_rejection_rate"] if gate else None,
            "gate_refusal_delta": how["delta"] if gate else None}
        for options in (["a", "b"], ["a", "b", "c", "d", "e", "f"]):  # never calibrated for: no promise holds
            body = ok_json(client.post("/predict", json={"question": "Which?", "options": options}))
            # ... and no level is stated: every one null, with the reason
            assert body["guarantees"] == {
                "holds": False, "reason": "option_count_not_calibrated", "since": None, "option_counts": counts,
                "answered_accuracy": None, "answered_accuracy_delta": None, "set_coverage": None,
                "set_coverage_delta": None, "gate_refusal_rate": None, "gate_refusal_delta": None}
            assert body["prediction_set_coverage"] is None and body["prediction_set"]
        counted = {line.split('options="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                   for line in client.get("/metrics").text.splitlines()
                   if line.startswith('ibedl_answers_without_guarantee_total{adapter="tiny"')}
        assert counted["2"] >= 1 and counted["6"] >= 1 and not {"3", "4", "5"} & set(counted)
        assert 'reason="option_count_not_calibrated"' in client.get("/metrics").text
        body = ok_json(client.post("/predict", json={**Q, "conformal": {"alpha": 0.2}}))
        assert body["guarantees"]["set_coverage"] == 0.8 == body["prediction_set_coverage"]

    def test_deterministic(self, client):
        a = ok_json(client.post("/predict", json=Q))
        b = ok_json(client.post("/predict", json=Q))
        a.pop("id"), b.pop("id")
        assert a == b

    def test_letter_map_and_five_options(self, client):
        r = client.post("/predict", json={"question": "Which?",
                                          "options": {"A": "a", "B": "b", "C": "c", "D": "d", "E": "e"},
                                          "context": "a passage"})
        assert r.status_code == 200
        check_invariants(r.json(), 5)

    def test_batch_in_order_equals_singles(self, client):
        items = [{**Q, "id": "x"}, {"question": "Which is tree?", "options": ["tree", "bird", "fish"], "id": "y"}]
        r = client.post("/predict/batch", json={"items": items})
        assert r.status_code == 200
        results = r.json()["results"]
        assert [x["id"] for x in results] == ["x", "y"]
        for item, res in zip(items, results, strict=True):
            single = ok_json(client.post("/predict", json=item))
            assert single["probabilities"] == pytest.approx(res["probabilities"], abs=1e-5)


class TestAbstention:
    def test_tightened_threshold_abstains(self, client):
        body = ok_json(client.post("/predict", json={**Q, "abstain": {"max_uncertainty": 0.0}}))
        assert body["abstained"] and body["abstain_reason"] == "max_uncertainty"
        body = ok_json(client.post("/predict", json={**Q, "abstain": {"min_confidence": 1.0}}))
        assert body["abstained"] and body["abstain_reason"] == "min_confidence"
        body = ok_json(client.post("/predict", json={**Q, "abstain": {"min_confidence": 1}}))  # an int is a number
        assert body["abstained"] and body["abstain_reason"] == "min_confidence"

    def test_requests_cannot_loosen_defaults(self, tiny_artifact, make_client, tmp_path):
        import shutil

        art = tmp_path / "strict"
        shutil.copytree(tiny_artifact, art)
        manifest = read_manifest(art)
        manifest.abstention["max_uncertainty"] = 0.0  # the adapter's default abstains on everything
        write_manifest(art, manifest)
        with make_client(artifact=art) as c:
            body = ok_json(c.post("/predict", json={**Q, "abstain": {"max_uncertainty": 1.0}}))
            assert body["abstained"] and body["abstain_reason"] == "max_uncertainty"


class TestBadInput:
    @pytest.mark.parametrize("payload,status,field", [
        ({"question": "q", "options": ["only one"]}, 422, "options"),
        ({"question": "q", "options": [f"o{i}" for i in range(27)]}, 422, "options"),
        ({"question": "q", "options": {"A": "a", "C": "c"}}, 422, "options"),
        ({"question": "q", "options": [1, 2]}, 422, "options.0"),  # the path, never the union member pydantic tried
        ({"question": "q", "options": {"A": 1, "B": "b"}}, 422, "options.A"),
        ({"question": "q", "options": "ab"}, 422, "options"),
        ({"question": "   ", "options": ["a", "b"]}, 422, "question"),
        ({"question": "q", "options": ["a", " "]}, 422, "options.1"),
        ({"question": "q", "options": ["a", "b"], "bogus": 1}, 422, "bogus"),
        ({"question": "q"}, 422, "options"),
        ({"question": "q", "options": ["a", "b"], "abstain": {"max_uncertainty": 2}}, 422, "abstain.max_uncertainty"),
        ({"question": "q", "options": ["a", "b"], "abstain": {"max_uncertainty": False}}, 422,
         "abstain.max_uncertainty"),
        ({"question": "q", "options": ["a", "b"], "abstain": {"min_confidence": "0.5"}}, 422, "abstain.min_confidence"),
        ({"question": "q", "options": ["a", "b"], "conformal": {"alpha": True}}, 422, "conformal.alpha"),
        ({"question": "\x1c\u2003", "options": ["a", "b"]}, 422, "question"),
        ({"question": "q" * 5000, "options": ["a", "b"]}, 413, "question"),
        ({"question": "q", "options": ["a", "b" * 2000]}, 413, "options.1"),
        ({"question": "q", "options": ["a", "b"], "context": "word " * 300}, 413, "context"),
    ])
    def test_rejected_with_error_shape(self, client, payload, status, field):
        r = client.post("/predict", json=payload)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"type", "message", "field"}
        assert err["field"] == field
        assert err["message"]

    def test_a_union_is_explained_by_the_member_the_input_took(self, client):
        err = client.post("/predict", json={"question": "q", "options": {"A": 1, "B": "b"}}).json()["error"]
        assert err["message"] == "Input should be a valid string"  # inside the map it sent, not "a valid list"
        err = client.post("/predict", json={"question": "q", "options": "ab"}).json()["error"]
        assert err["message"] == "Input should be a valid list or a valid dictionary"
        err = client.post("/predict", json={"question": "q", "options": [1, "b", 3]}).json()["error"]
        assert (err["field"], err["message"]) == ("options.0", "Input should be a valid string (and 1 more)")
        # an input no member took is an error of its own: counted, and told of when it comes first
        err = client.post("/predict", json={"question": "", "options": 5}).json()["error"]
        assert (err["field"], err["message"]) == ("question", "String should have at least 1 character (and 1 more)")
        err = client.post("/predict/batch", json={"items": [{"question": "q", "options": 5},
                                                            {"options": ["a", "b"]}]}).json()["error"]
        assert (err["field"], err["message"]) == (
            "items.0.options", "Input should be a valid list or a valid dictionary (and 1 more)")
        r = client.get("/v1/drift", params={"adapter": "a" * 200})
        assert r.status_code == 422 and r.json()["error"]["field"] == "adapter", r.text

    def test_invalid_json(self, client):
        r = client.post("/predict", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 422
        assert r.json()["error"]["type"] == "invalid_json"

    def test_wrong_content_type(self, client):
        r = client.post("/predict", content=json.dumps(Q), headers={"content-type": "text/plain"})
        assert r.status_code == 415
        assert r.json()["error"]["type"] == "unsupported_media_type"

    def test_body_too_large(self, make_client):
        with make_client(max_body_bytes=2048) as c:
            r = c.post("/predict", json={"question": "q", "options": ["a", "b"], "context": "x" * 5000})
            assert r.status_code == 413
            assert r.json()["error"]["type"] == "too_large"

    def test_chunked_body_too_large(self, make_client):
        """Without a Content-Length the limit is enforced while reading the stream."""
        def chunks():
            yield b'{"question": "q", "options": ["a", "b"], "context": "'
            for _ in range(10):
                yield b"x" * 500
            yield b'"}'

        with make_client(max_body_bytes=2048) as c:
            r = c.post("/predict", content=chunks(), headers={"content-type": "application/json"})
            assert "content-length" not in r.request.headers
            assert r.status_code == 413
            assert r.json()["error"]["type"] == "too_large"
            small = iter([json.dumps(Q).encode()])
            r = c.post("/predict", content=small, headers={"content-type": "application/json"})
            assert r.status_code == 200, r.text

    def test_batch_limits(self, make_client):
        with make_client(max_batch_items=2) as c:
            r = c.post("/predict/batch", json={"items": [Q, Q, Q]})
            assert r.status_code == 413 and r.json()["error"]["field"] == "items"
            r = c.post("/predict/batch", json={"items": [Q, {"question": "q", "options": ["a"]}]})
            assert r.status_code == 422 and r.json()["error"]["field"] == "items.1.options"
            r = c.post("/predict/batch", json={"items": []})
            assert r.status_code == 422

    def test_unknown_route_and_method(self, client):
        assert ok_json(client.get("/nope"), 404)["error"]["type"] == "not_found"
        assert client.get("/predict").status_code == 405

    def test_head_is_the_get_without_its_body(self, client):
        for path in ("/health/live", "/health/ready", "/v1/models", "/v2/health/ready", "/openapi.json"):
            got, head = client.get(path), client.head(path)
            assert head.status_code == got.status_code == 200, (path, head.status_code)
            assert head.content == b"" and head.headers["content-length"] == got.headers["content-length"], path
            assert head.headers["content-type"] == got.headers["content-type"] and head.headers["x-request-id"]
        assert client.head("/predict").status_code == 405 and client.head("/nope").status_code == 404
        assert 'method="HEAD",route="/v1/models",status="200"' in client.get("/metrics").text

    def test_undeclared_body_method_is_405(self, client):
        r = client.put("/health/live")
        assert r.status_code == 405 and "GET" in r.headers["allow"], r.text

    def test_body_not_utf8(self, client):
        r = client.post("/predict", content=b'{"question": "\xff", "options": ["a", "b"]}',
                        headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_body", r.text
        assert "not UTF-8 text" in r.json()["error"]["message"]  # not FastAPI's "error parsing the body"
        deep = b'{"question": "q", "options": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # json.loads recurses
        r = client.post("/predict", content=deep, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "nested deeper than the parser allows" in r.json()["error"]["message"], r.text

    def test_empty_body_is_said_to_be_empty(self, client):
        r = client.post("/predict", content=b"", headers={"content-type": "application/json"})
        assert r.status_code == 422 and r.json()["error"] == {
            "type": "invalid_json", "message": "the request body is empty: send a JSON object", "field": None}

    def test_compressed_body_is_415_naming_the_coding(self, client):
        import gzip

        for route in ("/predict", "/v2/models/tiny/infer"):
            r = client.post(route, content=gzip.compress(json.dumps(Q).encode()),
                            headers={"content-type": "application/json", "content-encoding": "gzip"})
            assert r.status_code == 415 and "Content-Encoding 'gzip' is not supported" in r.text, r.text
        r = client.post("/predict", json=Q, headers={"content-encoding": "identity"})
        assert r.status_code == 200, r.text


class TestLifecycle:
    def test_ready_503_while_loading_then_200(self, make_client):
        gate = threading.Event()

        def loader(settings):
            gate.wait(10)
            from tests.serve.conftest import load_predictor
            return load_predictor(settings)

        with make_client(loader=loader, ready=False) as c:
            assert c.get("/health/live").status_code == 200
            r = c.get("/health/ready")
            assert r.status_code == 503 and r.json()["status"] == "loading"
            r = c.post("/predict", json=Q)
            assert r.status_code == 503 and r.json()["error"]["type"] == "not_ready"
            gate.set()
            from tests.serve.conftest import wait_ready
            wait_ready(c)

    def test_the_model_loads_warms_and_answers_on_one_thread(self, make_client):
        """The service loads, warms and answers on one thread (not asyncio's default executor for the load and
        another for the passes): one OpenMP team, see ibedl.engine.engine.Engine."""
        from tests.conftest import thread_recording_loader

        threads: list[tuple[str, int]] = []
        with make_client(loader=thread_recording_loader(threads)) as c:
            for question in ("Which is sun?", "Which is moon?"):
                assert c.post("/predict", json={**Q, "question": question}).status_code == 200
        kinds = [k for k, _ in threads]
        assert kinds[0] == "load" and kinds.count("predict") >= 4, kinds
        assert len({t for _, t in threads}) == 1, threads

    def test_broken_artifact_is_logged_and_named_by_type_alone(self, make_client, tmp_path, caplog):
        (tmp_path / "manifest.json").write_text("{}")
        with make_client(artifact=tmp_path, ready=False) as c:
            body = wait_status(c, "failed")
            assert c.get("/health/ready").status_code == 503
            error = load_error(caplog, body)  # the log has the text, with the path; clients see the type alone
            assert error.startswith("ArtifactError: ") and "manifest" in error
            assert "manifest" not in body["reason"] and str(tmp_path) not in body["reason"]


class TestBatchingAndQueue:
    def test_concurrent_requests_share_forward_passes(self, make_client):
        with make_client(loader=slow_loader(0.3), max_wait_ms=50) as c:
            with ThreadPoolExecutor(8) as pool:
                codes = list(pool.map(lambda _: c.post("/predict", json=Q).status_code, range(8)))
            assert codes == [200] * 8
            text = c.get("/metrics").text
            count = float(_sample(text, "ibedl_batch_size_count"))
            total = float(_sample(text, "ibedl_batch_size_sum"))
            assert total == 8 and count < 8  # fewer forward passes than questions

    def test_queue_full_answers_503_with_retry_after(self, make_client):
        with make_client(loader=slow_loader(0.5), queue_size=2, max_batch_size=1) as c:
            with ThreadPoolExecutor(10) as pool:
                responses = list(pool.map(lambda _: c.post("/predict", json=Q), range(10)))
            full = [r for r in responses if r.status_code == 503]
            assert full, [r.status_code for r in responses]
            assert all(r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "overloaded" for r in full)
            assert any(r.status_code == 200 for r in responses)



async def _cancelled(task) -> None:
    task.cancel()


class TestCapacity:
    """Admission by expected completion (ibedl/serve/capacity.py), with a model whose time is per prompt token, the
    estimator's own assumption: 0.01 s per token plus the tiny model's few milliseconds."""

    def test_overload_is_refused_at_once_with_retry_after_and_nothing_times_out(self, make_client):
        with make_client(loader=per_token_loader(0.01), max_batch_size=1, request_timeout_s=1.5) as c:
            with ThreadPoolExecutor(12) as pool:
                responses = list(pool.map(lambda _: c.post("/predict", json=Q), range(12)))
            codes = [r.status_code for r in responses]
            assert set(codes) == {200, 503}, codes
            for r in responses:
                if r.status_code == 503:
                    assert r.json()["error"]["type"] == "overloaded"
                    assert int(r.headers["retry-after"]) >= 1
            text = c.get("/metrics").text
            assert float(_sample(text, 'ibedl_rejected_total{reason="capacity"}')) == codes.count(503)
            assert float(_sample(text, "ibedl_seconds_per_token")) == pytest.approx(0.01, rel=1.0)

    def test_a_request_arriving_right_after_sigterm_is_refused_before_the_watcher_looks(self, make_client):
        """uvicorn's SIGTERM handler sets ``should_exit``; a request that reaches the process on a kept-alive
        connection in the next instant is refused (503, so a gateway retries it elsewhere), not admitted."""
        from types import SimpleNamespace

        with make_client() as c:
            state = c.app.state.service
            assert c.post("/predict", json=Q).status_code == 200
            c.portal.call(_cancelled, state._watcher)  # no watcher: only the arrival itself can notice
            state.server = SimpleNamespace(should_exit=True)
            r = c.post("/predict", json=Q)
            assert r.status_code == 503 and r.json()["error"]["type"] == "not_ready", r.text
            assert c.get("/health/ready").json()["status"] == "draining"

    def test_a_lone_sequential_client_is_never_refused_however_late_others_were(self, make_client):
        """The overrun learnt from other requests' waits (here forced to its cap, as a background build taking the
        CPU would) never refuses a request with nothing ahead of it that fits alone: 1.5 x 4 x its model time is
        over the 1 s deadline, 1.5 x its model time is not."""
        from ibedl.engine.batcher import OVERRUN_MAX

        with make_client(loader=per_token_loader(0.01), request_timeout_s=1.0) as c:
            batcher = c.app.state.service.engine.batcher
            codes = []
            for _ in range(10):
                batcher.overrun = OVERRUN_MAX
                codes.append(c.post("/predict", json=Q).status_code)
            text = c.get("/metrics").text
        assert codes == [200] * 10
        assert 'ibedl_rejected_total{' not in text

    def test_client_deadline_header(self, make_client):
        with make_client(loader=per_token_loader(0.01)) as c:
            r = c.post("/predict", json=Q, headers={"X-Request-Timeout": "soon"})
            assert r.status_code == 422 and r.json()["error"]["field"] == "X-Request-Timeout"
            assert "'soon'" in r.json()["error"]["message"]
            for bad in ("0", "-1", "nan", "inf"):
                assert c.post("/predict", json=Q, headers={"X-Request-Timeout": bad}).status_code == 422
            # a deadline shorter than the question's model time alone: 504 at once, saying why
            r = c.post("/predict", json=Q, headers={"X-Request-Timeout": "0.01"})
            assert r.status_code == 504
            assert "own deadline (X-Request-Timeout over HTTP) cannot be met" in r.json()["error"]["message"]
            # shorter than even an idle service's smallest request: 504 before the body is read, never counted or
            # answered as overload (a gateway would retry a 503 elsewhere, forever)
            r = c.post("/predict", json=Q, headers={"X-Request-Timeout": "1e-9"})
            assert r.status_code == 504 and "own deadline" in r.json()["error"]["message"], r.text
            assert "shorter than even the smallest request takes alone" in r.json()["error"]["message"]
            assert 'reason="capacity"' not in c.get("/metrics").text
            # the same model time over the server's own deadline: the model is too slow now (it may recover)
            with make_client(loader=per_token_loader(0.01), request_timeout_s=0.05) as slow:
                r = slow.post("/predict", json=Q)
                assert r.status_code == 503 and "model time" in r.json()["error"]["message"]
                assert int(r.headers["retry-after"]) >= 1
            # a longer one than the server's maximum is cut to it, not refused
            assert c.post("/predict", json=Q, headers={"X-Request-Timeout": "3600"}).status_code == 200

    def test_batch_over_the_token_budget_is_413(self, make_client):
        with make_client(max_request_tokens=60) as c:
            assert c.post("/predict/batch", json={"items": [Q]}).status_code == 200
            r = c.post("/predict/batch", json={"items": [Q] * 4})
            assert r.status_code == 413 and r.json()["error"]["field"] == "items"
            assert "limit per request is 60" in r.json()["error"]["message"]

    def test_requests_admitted_before_a_drain_are_answered_later_ones_refused(self, make_client):
        with make_client(loader=slow_loader(0.5), max_batch_size=1) as c:
            state = c.app.state.service
            with ThreadPoolExecutor(1) as pool:
                first = pool.submit(c.post, "/predict", json=Q)
                deadline = time.monotonic() + 30
                while float(_sample(c.get("/metrics").text, "ibedl_inflight_requests")) < 1:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                c.portal.call(state.engine.drain)
                late = c.post("/predict", json=Q)
                assert late.status_code == 503 and late.json()["error"]["type"] == "not_ready"
                assert late.headers["retry-after"]
                assert ok_json(c.get("/health/ready"), 503)["status"] == "draining"
                assert first.result().status_code == 200


class TestFailClosed:
    def test_nan_weights_are_not_ready(self, tiny_artifact, make_client, tmp_path, caplog):
        import shutil

        from safetensors.torch import load_file, save_file

        from ibedl.core.artifact import files_sha256

        art = tmp_path / "nan-head"
        shutil.copytree(tiny_artifact, art)
        tensors = load_file(art / "head.safetensors")
        name = sorted(tensors)[0]
        tensors[name] = torch.full_like(tensors[name], float("nan"))
        save_file(tensors, art / "head.safetensors")
        with make_client(artifact=art, ready=False) as c:  # changed after its manifest: the checksum refuses it
            body = wait_status(c, "failed")
            assert "differ from the sha256 the manifest records" in load_error(caplog, body)
        caplog.clear()
        manifest = read_manifest(art)
        manifest.files = files_sha256(art, manifest.members)  # as a run that diverged to NaN would record them
        write_manifest(art, manifest)
        with make_client(artifact=art, ready=False) as c:
            body = wait_status(c, "failed")
            error = load_error(caplog, body)
            assert "NaN or inf" in error and "head" in error and "NaN" not in body["reason"]
            r = c.post("/predict", json=Q)
            assert r.status_code == 503 and str(tmp_path) not in r.text

    def test_non_finite_outputs_are_never_an_answer(self, make_client):
        def loader(settings):
            from tests.serve.conftest import load_predictor

            predictor = load_predictor(settings)
            original = predictor.predict

            def predict(questions, truncate_context=True):
                preds = original(questions, truncate_context)
                if any(q.question == "break" for q in questions):
                    preds = [dataclasses.replace(p, probs=[float("nan")] * len(p.probs)) if q.question == "break"
                             else p for q, p in zip(questions, preds, strict=True)]
                return preds

            predictor.predict = predict
            return predictor

        with make_client(loader=loader) as c:
            r = c.post("/predict", json={**Q, "question": "break"})
            assert r.status_code == 500 and r.json()["error"]["type"] == "model_error"
            assert "retry-after" not in r.headers
            r = c.post("/predict/batch", json={"items": [Q, {**Q, "question": "break"}]})
            assert r.status_code == 500 and "items [1]" in r.json()["error"]["message"]
            assert c.post("/predict", json=Q).status_code == 200
            assert float(_sample(c.get("/metrics").text, "ibedl_nonfinite_outputs_total")) == 2


class TestMetadataAndMetrics:
    def test_models(self, client):
        data = ok_json(client.get("/v1/models"))["data"][0]
        assert data["method"] == "ib_edl" and data["name"] == "tiny"
        assert {"validation"} <= set(data["metrics"])
        assert "max_uncertainty" in data["abstention"]
        assert data["training_data"]["train"][0]["dataset"] == "jsonl"

    def test_metrics_count_predictions_not_probes(self, client):
        client.post("/predict", json=Q)
        client.post("/predict", json={"question": "q", "options": ["a"]})
        client.get("/health/ready")
        text = client.get("/metrics").text
        assert 'ibedl_requests_total{method="POST",route="/predict",status="200"} 1.0' in text
        assert 'ibedl_requests_total{method="POST",route="/predict",status="422"} 1.0' in text
        assert "/health" not in text and 'route="/metrics"' not in text
        # refused before the route runs (content type, size, a deadline): counted under the route all the same
        client.post("/predict", content=b"q", headers={"content-type": "text/plain"})
        client.post("/predict/batch", json={"items": [Q]}, headers={"X-Request-Timeout": "soon"})
        client.post("/v2/models/tiny/infer", json={"inputs": "x" * 2_000_000})
        client.post("/nowhere", json=Q)
        text = client.get("/metrics").text
        assert 'ibedl_requests_total{method="POST",route="/predict",status="415"} 1.0' in text
        assert 'ibedl_requests_total{method="POST",route="/predict/batch",status="422"} 1.0' in text
        assert 'ibedl_requests_total{method="POST",route="/v2/models/{model}/infer",status="413"} 1.0' in text
        assert 'ibedl_requests_total{method="POST",route="unmatched",status="404"} 1.0' in text
        # timed only when the route answered: the 200 and the route's own 422, not the three refused before it
        assert 'ibedl_request_latency_seconds_count{route="/predict"} 2.0' in text

        for method in ("BREW", "XYZZY1", "XYZZY2"):
            client.request(method, "/predict")
        text = client.get("/metrics").text
        assert 'method="other"' in text and "BREW" not in text and "XYZZY" not in text  # bounded label values
        assert 'ibedl_uncertainty_mass_count{adapter="tiny"} 1.0' in text
        assert 'ibedl_model_info{adapter="tiny"' in text
        for name in ("ibedl_drift_ks", "ibedl_drift_psi", "ibedl_drift_alarm", "ibedl_queue_depth", "ibedl_ready 1.0"):
            assert name in text

    def test_a_refusal_before_a_route_the_app_itself_adds_is_counted_under_it(self, make_client):
        with make_client(api_token="t" * 32) as c:
            assert c.get("/openapi.json").status_code == 401 and c.get("/docs").status_code == 401
            text = c.get("/metrics", headers={"Authorization": "Bearer " + "t" * 32}).text
        assert 'ibedl_requests_total{method="GET",route="/openapi.json",status="401"} 1.0' in text
        assert 'ibedl_requests_total{method="GET",route="/docs",status="401"} 1.0' in text
        assert 'route="unmatched"' not in text

    def test_drift_endpoint(self, client):
        for _ in range(3):
            client.post("/predict", json=Q)
        d = ok_json(client.get("/v1/drift"))
        assert d["statistic"] == "uncertainty_mass" and d["window"] == 3 and d["alarm"] is False
        assert d["ks_threshold"] > 0

    def test_openapi_docs(self, client):
        assert client.get("/docs").status_code == 200
        paths = ok_json(client.get("/openapi.json"))["paths"]
        assert {"/predict", "/predict/batch", "/v1/models", "/v1/drift", "/health/ready"} <= set(paths)


def _sample(text: str, name: str) -> str:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return line.split()[-1]
    raise AssertionError(f"{name} not in metrics")


@pytest.mark.parametrize("broken", ["missing", "raising"])
def test_a_grpc_door_that_cannot_be_imported_fails_readiness_with_the_remedy_not_loading_forever(make_client,
                                                                                                    monkeypatch,
                                                                                                    broken):
    import sys
    import types

    if broken == "missing":  # as without tritonclient: ImportError
        monkeypatch.setitem(sys.modules, "ibedl.serve.grpc_door", None)
    else:  # as tritonclient without its grpc part: a RuntimeError at import
        module = types.ModuleType("ibedl.serve.grpc_door")
        monkeypatch.setitem(sys.modules, "ibedl.serve.grpc_door", module)
        monkeypatch.setattr(module, "__getattr__", lambda name: (_ for _ in ()).throw(
            RuntimeError("The installation does not include grpc support")), raising=False)
    with make_client(ready=False, grpc=True, grpc_port=0) as c:
        body = wait_status(c, "failed")
        assert "gRPC door cannot be imported" in body["reason"] and "IBEDL_GRPC=false" in body["reason"]
        assert ("ModuleNotFoundError" if broken == "missing" else "RuntimeError") in body["reason"]
        assert c.post("/predict", json={"question": "q?", "options": ["a", "b"]}).status_code == 503


def test_answering_takes_no_worker_thread_hop(client, monkeypatch):
    """Every dependency and route of an answer is awaited on the event loop: FastAPI runs a plain ``def`` dependency
    in a worker thread, a hop per request that cost the loop about 0.3 ms of CPU an answer
    (benchmarks/results/service_bound_cpu*.json)."""
    import anyio.to_thread

    hops, run_sync = [], anyio.to_thread.run_sync

    async def recorded(func, *args, **kwargs):
        hops.append(getattr(func, "__qualname__", repr(func)))
        return await run_sync(func, *args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", recorded)
    assert client.post("/predict", json=Q).status_code == 200
    assert client.post("/predict/batch", json={"items": [Q, Q]}).status_code == 200
    assert client.get("/v1/models").status_code == 200
    assert client.get("/health/ready").status_code == 200
    assert hops == []
