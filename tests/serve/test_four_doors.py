"""One running engine, four doors: the same questions through HTTP v1 (``/predict``), the Open Inference Protocol
over REST (``tritonclient.http``) and over gRPC (``tritonclient.grpc``), and the Python API (``ibedl.api.Model`` on
the service's own engine) get the same answers; a request the engine refuses is refused through each with the same
reason and the same Retry-After (the protocol's own status and body)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc
from tritonclient.utils import serialize_byte_tensor

from ibedl.api import Model
from ibedl.engine.errors import Overloaded
from ibedl.engine.observer import Observer
from ibedl.serve.app import create_app
from ibedl.serve.settings import Settings
from tests.serve.conftest import load_predictor, per_token_loader, uvicorn_server

QUESTIONS = [
    {"question": "Which is the sun?", "options": ["sun", "moon", "tree"], "context": "The sun is a star."},
    {"question": "Which one is a tree?", "options": ["rock", "oak", "cloud", "river"]},
    {"question": "Hot or cold?", "options": ["hot", "cold"]},
]
FIELDS = ("letter", "abstained", "prediction_set", "holds")


@contextmanager
def doors(tiny_artifact, loader=None, **settings):
    """A service on uvicorn (HTTP) with its gRPC door, and its engine: (HTTP URL, gRPC address, engine)."""
    app = create_app(Settings(artifact=tiny_artifact, max_tokens=96, drift_bootstrap=100, **settings), loader=loader)
    with uvicorn_server(app) as url:
        state = app.state.service
        yield url, f"127.0.0.1:{state.grpc.port}", state.engine


def summary(letter, probabilities, masses, uncertainty, abstained, prediction_set, holds) -> dict:
    return {"letter": letter, "probabilities": np.asarray(probabilities, dtype=np.float64),
            "masses": np.asarray(masses, dtype=np.float64), "uncertainty": float(uncertainty),
            "abstained": bool(abstained), "prediction_set": prediction_set, "holds": bool(holds)}


def of_answer(a: dict) -> dict:
    return summary(a["prediction"]["letter"], list(a["probabilities"].values()), list(a["belief_masses"].values()),
                   a["uncertainty_mass"], a["abstained"], "".join(a["prediction_set"] or []),
                   a["guarantees"]["holds"])


def of_tensors(result) -> dict:
    text = [x.decode() if isinstance(x, bytes) else x for x in (result.as_numpy("answer")[0],
                                                                result.as_numpy("prediction_set")[0])]
    return summary(text[0], result.as_numpy("probabilities")[0], result.as_numpy("belief_masses")[0],
                   result.as_numpy("uncertainty_mass")[0], result.as_numpy("abstained")[0], text[1],
                   result.as_numpy("guarantee_holds")[0])


def tensors(module, q: dict, **how) -> list:
    rows = {"question": [q["question"]], "options": [q["options"]], "context": [q.get("context") or ""]}
    out = []
    for name, value in rows.items():
        data = np.array(value, dtype=object)
        out.append(module.InferInput(name, list(data.shape), "BYTES"))
        out[-1].set_data_from_numpy(data, **how)
    return out


def through_http(url: str, q: dict) -> dict:
    r = httpx.post(url + "/predict", json=q, timeout=60)
    assert r.status_code == 200, r.text
    return of_answer(r.json())


def through_oip_rest(url: str, q: dict) -> dict:
    client = triton_http.InferenceServerClient(url.removeprefix("http://"))
    return of_tensors(client.infer("tiny", tensors(triton_http, q, binary_data=False)))


def through_oip_grpc(address: str, q: dict) -> dict:
    with triton_grpc.InferenceServerClient(address) as client:
        return of_tensors(client.infer("tiny", tensors(triton_grpc, q)))


def through_python(engine, q: dict) -> dict:
    (answer,) = Model(engine).predict([q])
    return of_answer(answer.model_dump())


def test_the_same_questions_get_the_same_answers_through_every_door(tiny_artifact):
    with doors(tiny_artifact) as (url, address, engine):
        for q in QUESTIONS:  # one at a time: every door's pass holds this question alone
            answers = {"http": through_http(url, q), "oip-rest": through_oip_rest(url, q),
                       "oip-grpc": through_oip_grpc(address, q), "python": through_python(engine, q)}
            first = answers["http"]
            assert len(first["probabilities"]) == len(q["options"])
            for door, a in answers.items():
                assert {k: a[k] for k in FIELDS} == {k: first[k] for k in FIELDS}, door
                for key in ("probabilities", "masses", "uncertainty"):  # float32 on the wire, float64 in JSON
                    np.testing.assert_allclose(a[key], first[key], rtol=1e-6, atol=1e-7, err_msg=f"{door} {key}")


def grpc_refusal(address: str, q: dict, timeout: float = 60) -> tuple[grpc.StatusCode, str, dict]:
    """A raw ModelInfer call (tritonclient hides the trailing metadata): its status code, details and trailers."""
    request = pb.ModelInferRequest(model_name="tiny")
    for name, value in (("question", [q["question"]]), ("options", [q["options"]])):
        data = np.array(value, dtype=object)
        request.inputs.add(name=name, datatype="BYTES", shape=list(data.shape))
        request.raw_input_contents.append(serialize_byte_tensor(data).item())
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as refused:
        pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=timeout)
    e = refused.value
    return e.code(), e.details(), dict(e.trailing_metadata() or ())


def test_a_refusal_has_the_same_reason_and_retry_after_through_every_door(tiny_artifact):
    """A question that needs more model time than the deadline leaves (0.01 s per prompt token, a 0.05 s request
    timeout): refused before the model runs, as overloaded, with the wait in whole seconds."""
    q = QUESTIONS[1]
    with doors(tiny_artifact, per_token_loader(0.01), request_timeout_s=0.05) as (url, address, engine):
        v1 = httpx.post(url + "/predict", json=q, timeout=60)
        rest = httpx.post(url + "/v2/models/tiny/infer", timeout=60, json={"inputs": [
            {"name": "question", "datatype": "BYTES", "shape": [1], "data": [q["question"]]},
            {"name": "options", "datatype": "BYTES", "shape": [1, 4], "data": q["options"]}]})
        code, details, trailers = grpc_refusal(address, q)
        with pytest.raises(Overloaded) as python:
            Model(engine).predict([q], timeout_s=0.05)  # the service's deadline, asked for
        metrics = httpx.get(url + "/metrics").text
    assert v1.status_code == rest.status_code == 503 and code == grpc.StatusCode.UNAVAILABLE
    message = v1.json()["error"]["message"]
    assert v1.json()["error"]["type"] == python.value.type == "overloaded"
    assert rest.json()["error"].startswith("overloaded: ") and details.startswith("overloaded: ")
    cause = message.split(" and its deadline")[0]  # the rest says how long the deadline left, to the millisecond
    assert cause.startswith("the request needs about") and "of model time" in cause
    assert all(text.startswith(cause) for text in (rest.json()["error"].removeprefix("overloaded: "),
                                                   details.removeprefix("overloaded: "), python.value.message))
    retry = {v1.headers["retry-after"], rest.headers["retry-after"], trailers["retry-after"],
             str(python.value.retry_after)}
    assert len(retry) == 1 and int(retry.pop()) >= 1
    assert 'ibedl_rejected_total{reason="capacity"} 4.0' in metrics  # every door's refusal, counted once


def test_behind_a_pass_in_flight_every_door_refuses_at_once_with_the_same_retry_after(tiny_artifact):
    """The cheap check before a body is read: a pass estimated at a few seconds holds the model (0.05 s per prompt
    token), and each door asks with a 1 s deadline (X-Request-Timeout, the gRPC deadline, ``timeout_s``). With the
    admission clock held still while they ask, each is refused at the same instant: overloaded, with one Retry-After
    (1.5 x the wait minus the 1 s left, rounded up: at least 2), before the model sees it."""
    armed, gate, held = threading.Event(), threading.Event(), threading.Event()
    q = QUESTIONS[1]
    with doors(tiny_artifact, gated_loader(armed, gate, held, per_token_s=0.05), max_batch_size=1,
               max_wait_ms=0) as (url, address, engine), ThreadPoolExecutor(1) as pool:
        armed.set()
        first = pool.submit(through_http, url, q)
        assert held.wait(60)
        admission, batcher, now = engine.admission, engine.batcher, engine.admission.clock()
        clock = admission.clock
        admission.clock = batcher.clock = lambda: now
        try:
            v1 = httpx.post(url + "/predict", json=q, headers={"X-Request-Timeout": "1"}, timeout=60)
            rest = httpx.post(url + "/v2/models/tiny/infer", headers={"X-Request-Timeout": "1"}, timeout=60, json={
                "inputs": [{"name": "question", "datatype": "BYTES", "shape": [1], "data": [q["question"]]},
                           {"name": "options", "datatype": "BYTES", "shape": [1, 4], "data": q["options"]}]})
            code, details, trailers = grpc_refusal(address, q, timeout=1.0)
            with pytest.raises(Overloaded) as python:
                Model(engine).predict([q], timeout_s=1.0)
        finally:
            admission.clock = batcher.clock = clock
        gate.set()
        assert first.result(timeout=60)["letter"]
        metrics = httpx.get(url + "/metrics").text
    assert v1.status_code == rest.status_code == 503 and code == grpc.StatusCode.UNAVAILABLE
    busy = "overloaded: the service is busy: no request could be answered before its deadline now"
    assert f'{v1.json()["error"]["type"]}: {v1.json()["error"]["message"]}'.startswith(busy)
    assert rest.json()["error"].startswith(busy) and details.startswith(busy)
    assert f"{python.value.type}: {python.value.message}".startswith(busy)
    retry = {v1.headers["retry-after"], rest.headers["retry-after"], trailers["retry-after"],
             str(python.value.retry_after)}
    assert len(retry) == 1 and int(retry.pop()) >= 2  # the pass in flight's wait, not the minimum of 1
    assert 'ibedl_rejected_total{reason="capacity"} 4.0' in metrics
    assert 'ibedl_batch_size_count 1.0' in metrics  # one pass (the held one): no refused question reached the model


def test_grpc_health_metadata_and_errors(tiny_artifact):
    with doors(tiny_artifact, api_token="t" * 32) as (url, address, _engine), \
            triton_grpc.InferenceServerClient(address) as client:
        assert client.is_server_live() and client.is_server_ready()  # the probes are open, as over HTTP
        with pytest.raises(triton_grpc.InferenceServerException, match="UNAUTHENTICATED"):
            client.infer("tiny", tensors(triton_grpc, QUESTIONS[2]))
        auth = {"authorization": "Bearer " + "t" * 32}
        meta = client.get_model_metadata("tiny", headers=auth)
        assert meta.name == "tiny" and meta.platform == "ibedl"
        assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
            ("question", "BYTES", [-1]), ("options", "BYTES", [-1, -1]), ("context", "BYTES", [-1])]
        assert client.is_model_ready("tiny", headers=auth)
        with pytest.raises(triton_grpc.InferenceServerException, match="NOT_FOUND") as absent:
            client.infer("absent", tensors(triton_grpc, QUESTIONS[2]), headers=auth)
        assert "invalid_request: no adapter 'absent' is served" in absent.value.message()
        bad = tensors(triton_grpc, QUESTIONS[2])[:1]  # no options
        with pytest.raises(triton_grpc.InferenceServerException, match="INVALID_ARGUMENT"):
            client.infer("tiny", bad, headers=auth)
        with pytest.raises(triton_grpc.InferenceServerException, match=r"unknown outputs \['logits'\]"):
            client.infer("tiny", tensors(triton_grpc, QUESTIONS[2]), headers=auth,
                         outputs=[triton_grpc.InferRequestedOutput("logits")])
        assert client.infer("tiny", tensors(triton_grpc, QUESTIONS[2]), headers=auth).as_numpy("answer") is not None
        metrics = httpx.get(url + "/metrics", headers=auth).text
    route = 'method="grpc",route="/inference.GRPCInferenceService/ModelInfer"'
    for status, n in (("OK", 1), ("NOT_FOUND", 1), ("INVALID_ARGUMENT", 2)):  # counted as HTTP requests are
        assert f'ibedl_requests_total{{{route},status="{status}"}} {n}.0' in metrics


def test_a_second_service_on_a_grpc_port_in_use_fails_saying_so(tiny_artifact):
    """gRPC's default SO_REUSEPORT let a second service bind the first one's gRPC port and take half its calls,
    silently: it now cannot, and its readiness says why."""
    from fastapi.testclient import TestClient

    with doors(tiny_artifact) as (_url, address, _engine):
        port = int(address.rsplit(":", 1)[1])
        app = create_app(Settings(artifact=tiny_artifact, max_tokens=96, grpc_port=port))
        with TestClient(app, raise_server_exceptions=False) as second:
            health = second.get("/health/ready").json()
    assert health["status"] == "failed" and f"the gRPC port 127.0.0.1:{port} cannot be opened" in health["reason"]


def output_names(response) -> list[str]:
    outputs = response["outputs"] if isinstance(response, dict) else response.outputs  # REST's JSON, gRPC's message
    return [o["name"] if isinstance(o, dict) else o.name for o in outputs]


def test_an_adapter_without_a_dirichlet_and_a_pinned_version_through_both_protocol_doors(tiny_artifact,
                                                                                          tiny_map_artifact):
    """A softmax head (MAP) answers no belief masses nor uncertainty mass: each protocol door's metadata leaves them
    out, its answers too, and asking for them says why (over REST they were NaN, which JSON cannot carry: a 500 on
    every request). A model version (the path's /versions/{v} over REST, the request's over gRPC) is the adapter's
    own or the protocol's "no such model"."""
    app = create_app(Settings(artifacts=f"{tiny_artifact},{tiny_map_artifact}", max_tokens=96, drift_bootstrap=100))
    q = QUESTIONS[1]
    with uvicorn_server(app) as url, \
            triton_grpc.InferenceServerClient(f"127.0.0.1:{app.state.service.grpc.port}") as over_grpc:
        want = httpx.post(url + "/predict", json={**q, "adapter": "tiny-map"}, timeout=60).json()
        assert want["belief_masses"] is None and want["uncertainty_mass"] is None
        over_rest = triton_http.InferenceServerClient(url.removeprefix("http://"))
        for client, module, how in ((over_rest, triton_http, {"binary_data": False}), (over_grpc, triton_grpc, {})):
            names = output_names(client.get_model_metadata("tiny-map"))
            assert "probabilities" in names and not {"belief_masses", "uncertainty_mass"} & set(names)
            assert {"belief_masses", "uncertainty_mass"} <= set(output_names(client.get_model_metadata("tiny")))
            result = client.infer("tiny-map", tensors(module, q, **how))
            assert output_names(result.get_response()) == names
            np.testing.assert_allclose(result.as_numpy("probabilities")[0], list(want["probabilities"].values()),
                                       rtol=1e-5, atol=1e-6)
            with pytest.raises(module.InferenceServerException, match=r"unknown outputs \['uncertainty_mass'\]; "
                               r"model 'tiny-map' has .* its head answers no Dirichlet"):
                client.infer("tiny-map", tensors(module, q, **how),
                             outputs=[module.InferRequestedOutput("uncertainty_mass")])
            version = want["adapter"]["version"]
            assert client.is_model_ready("tiny-map", model_version=version)
            pinned = client.infer("tiny-map", tensors(module, q, **how), model_version=version)
            assert pinned.as_numpy("answer_index").tolist() == [want["prediction"]["index"]]
            with pytest.raises(module.InferenceServerException,
                               match=f"model 'tiny-map' is served at version '{version}', not '{version}9'"):
                client.infer("tiny-map", tensors(module, q, **how), model_version=version + "9")


class Watch(Observer):
    """Events the test waits on: questions waiting for the model, and the engine's readiness going."""

    def __init__(self, waiting: int) -> None:
        self.waiting, self.queued, self.draining = waiting, threading.Event(), threading.Event()

    def depth(self, questions: int) -> None:
        if questions >= self.waiting:
            self.queued.set()

    def readiness(self, ready: bool) -> None:
        if not ready:
            self.draining.set()


def gated_loader(armed: threading.Event, gate: threading.Event, held: threading.Event, per_token_s: float = 0.0):
    """A loader whose model, once ``armed``, holds its passes until ``gate`` opens (``held`` says one is held); with
    ``per_token_s`` it also takes that long per prompt token (what the warm-up at load measures)."""

    def load(settings):
        predictor = per_token_loader(per_token_s)(settings) if per_token_s else load_predictor(settings)
        original = predictor.predict

        def predict(questions, truncate_context=True):
            if armed.is_set():
                held.set()
                assert gate.wait(60), "the test never opened the gate"
            return original(questions, truncate_context)

        predictor.predict = predict
        return predictor

    return load


def test_on_sigterm_no_door_loses_an_admitted_request(tiny_artifact):
    """Four questions admitted, one per door, the model held on the first; then uvicorn's SIGTERM flag: the engine
    drains (a call arriving now is refused, UNAVAILABLE over gRPC), and once the model goes on every admitted
    question is answered through its door."""
    armed, gate, held = threading.Event(), threading.Event(), threading.Event()
    settings = Settings(artifact=tiny_artifact, max_tokens=96, drift_bootstrap=100, max_batch_size=1,
                        max_wait_ms=0, shutdown_grace_s=60)
    app = create_app(settings, loader=gated_loader(armed, gate, held))
    state, watch = app.state.service, Watch(waiting=3)
    state.engine.observers.append(watch)
    with uvicorn_server(app) as url, ThreadPoolExecutor(4) as pool:
        server = state.server
        address, q = f"127.0.0.1:{state.grpc.port}", QUESTIONS[0]
        armed.set()
        calls = [pool.submit(through_http, url, q)]
        assert held.wait(60)  # the first question is in the model's pass; the next three will wait in the queue
        calls += [pool.submit(through_oip_rest, url, q), pool.submit(through_oip_grpc, address, q),
                  pool.submit(through_python, state.engine, q)]
        assert watch.queued.wait(60)
        server.should_exit = True  # what uvicorn's SIGTERM handler does
        assert watch.draining.wait(60)
        code, details, _ = grpc_refusal(address, q)
        assert code == grpc.StatusCode.UNAVAILABLE and details.startswith("not_ready: the service is draining")
        gate.set()
        answers = [c.result(timeout=60) for c in calls]
    first = answers[0]
    for a in answers:
        assert {k: a[k] for k in FIELDS} == {k: first[k] for k in FIELDS}
        np.testing.assert_allclose(a["probabilities"], first["probabilities"], rtol=1e-6, atol=1e-7)


def test_a_request_over_the_item_limit_is_refused_before_its_items_are_read_through_every_door(tiny_artifact):
    """Three items where two are allowed, each of them malformed (one option): 413/RESOURCE_EXHAUSTED too_large,
    not the first item's error, so none was built (tens of thousands of items in a 1 MB body took the event loop a
    second to build before the count was checked)."""
    bad = {"question": "q?", "options": ["only one"]}
    with doors(tiny_artifact, max_batch_items=2, feedback_key="k" * 32) as (url, address, _engine):
        batch = httpx.post(url + "/predict/batch", json={"items": [bad] * 3}, timeout=60)
        labels = httpx.post(url + "/v1/feedback/batch", json={"items": [{"receipt": "x"}] * 3}, timeout=60)
        rest = httpx.post(url + "/v2/models/tiny/infer", timeout=60, json={"inputs": [
            {"name": "question", "datatype": "BYTES", "shape": [3], "data": ["q?"] * 3},
            {"name": "options", "datatype": "BYTES", "shape": [3, 1], "data": ["only one"] * 3}]})
        request = pb.ModelInferRequest(model_name="tiny")
        for name, value in (("question", ["q?"] * 3), ("options", [["only one"]] * 3)):
            data = np.array(value, dtype=object)
            request.inputs.add(name=name, datatype="BYTES", shape=list(data.shape))
            request.raw_input_contents.append(serialize_byte_tensor(data).item())
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as refused:
            pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=60)
        fine = httpx.post(url + "/predict/batch", json={"items": [bad] * 2}, timeout=60)  # within it: items checked
    for r in (batch, labels):
        assert r.status_code == 413, r.text
        assert r.json()["error"] == {"type": "too_large", "message": "3 items; the limit is 2", "field": "items"}
    assert rest.status_code == 413 and rest.json()["error"] == "too_large: 3 items; the limit is 2"
    assert "too_large: 3 items; the limit is 2" in refused.value.details()
    assert fine.status_code == 422 and fine.json()["error"]["field"] == "items.0.options"
