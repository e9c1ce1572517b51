"""The Open Inference Protocol door (ibedl/serve/oip.py), called by a maintained client of that protocol: Triton's
``tritonclient.http``, against a running service on the tiny artifact. Its answers are the /predict/batch ones."""

from __future__ import annotations

import re

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.conftest import ServiceProcess

QUESTIONS = ["Which is the sun?", "Which one is a tree?"]
OPTIONS = [["sun", "moon", "tree"], ["rock", "oak", "cloud"]]
CONTEXTS = ["The sun is a star.", ""]


@pytest.fixture(scope="module")
def service(tiny_artifact, tmp_path_factory):
    proc = ServiceProcess(tiny_artifact, {"IBEDL_BACKEND": "torch", "IBEDL_MAX_TOKENS": "96"},
                          log_path=tmp_path_factory.mktemp("oip") / "service.log")
    try:
        proc.wait_ready(timeout=300)
        yield proc
    finally:
        proc.stop()


def bytes_input(name: str, rows: list) -> triton.InferInput:
    data = np.array(rows, dtype=object)
    tensor = triton.InferInput(name, list(data.shape), "BYTES")
    tensor.set_data_from_numpy(data, binary_data=False)
    return tensor


def infer(client, model: str, inputs: list, outputs: list[str] | None = None, binary: bool = False):
    requested = [triton.InferRequestedOutput(n, binary_data=binary) for n in outputs] if outputs else None
    return client.infer(model, inputs, outputs=requested)


def test_health_and_metadata_through_tritons_client(service):
    client = triton.InferenceServerClient(service.url.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("tiny")
    assert not client.is_model_ready("absent")
    meta = client.get_model_metadata("tiny")
    assert meta["name"] == "tiny" and meta["platform"] == "ibedl" and len(meta["versions"]) == 1
    assert [(i["name"], i["datatype"], i["shape"]) for i in meta["inputs"]] == [
        ("question", "BYTES", [-1]), ("options", "BYTES", [-1, -1]), ("context", "BYTES", [-1])]
    assert {"answer", "probabilities", "belief_masses", "uncertainty_mass", "abstained", "prediction_set",
            "guarantee_holds", "receipt"} <= {o["name"] for o in meta["outputs"]}
    assert client.get_server_metadata()["name"] == "ibedl"


def test_infer_answers_as_predict_batch_does(service):
    client = triton.InferenceServerClient(service.url.removeprefix("http://"))
    names = ["answer", "answer_index", "probabilities", "belief_masses", "uncertainty_mass", "confidence",
             "abstained", "abstain_reason", "prediction_set", "guarantee_holds"]
    result = infer(client, "tiny", [bytes_input("question", QUESTIONS), bytes_input("options", OPTIONS),
                                    bytes_input("context", CONTEXTS)], names)
    batch = httpx.post(service.url + "/predict/batch", timeout=60, json={"items": [
        {"question": q, "options": o, "context": c or None} for q, o, c in zip(QUESTIONS, OPTIONS, CONTEXTS,
                                                                               strict=True)]}).json()["results"]
    assert result.get_response()["model_name"] == "tiny"
    probs = result.as_numpy("probabilities")
    assert probs.shape == (2, 3) and probs.dtype == np.float32
    np.testing.assert_allclose(probs, [list(r["probabilities"].values()) for r in batch], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.as_numpy("belief_masses"), [list(r["belief_masses"].values()) for r in batch],
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.as_numpy("uncertainty_mass"), [r["uncertainty_mass"] for r in batch],
                               rtol=1e-5)
    assert [a.decode() if isinstance(a, bytes) else a for a in result.as_numpy("answer")] == \
        [r["prediction"]["letter"] for r in batch]
    assert result.as_numpy("answer_index").tolist() == [r["prediction"]["index"] for r in batch]
    assert result.as_numpy("abstained").tolist() == [r["abstained"] for r in batch]
    sets = [s.decode() if isinstance(s, bytes) else s for s in result.as_numpy("prediction_set")]
    assert sets == ["".join(r["prediction_set"] or []) for r in batch]
    assert result.as_numpy("guarantee_holds").tolist() == [r["guarantees"]["holds"] for r in batch]
    assert result.as_numpy("receipt") is None  # not asked for: not sent


def test_refusals_say_what_is_wrong(service):
    client = triton.InferenceServerClient(service.url.removeprefix("http://"))
    good = [bytes_input("question", QUESTIONS), bytes_input("options", OPTIONS)]
    with pytest.raises(InferenceServerException,
                       match=r"invalid_request: no adapter 'absent' is served; choose one of \['tiny'\]"):
        infer(client, "absent", good, ["answer"])
    with pytest.raises(InferenceServerException, match=r"input 'options' has shape \[1, 3\] and 3 values; it must "
                                                        r"be \[B, C\] with B = 2"):
        infer(client, "tiny", [good[0], bytes_input("options", OPTIONS[:1])], ["answer"])
    with pytest.raises(InferenceServerException, match=r"unknown outputs \['logits'\]"):
        infer(client, "tiny", good, ["logits"])
    with pytest.raises(InferenceServerException, match="binary tensor data is not supported"):
        data = np.array(QUESTIONS, dtype=object)
        binary = triton.InferInput("question", [2], "BYTES")
        binary.set_data_from_numpy(data, binary_data=True)
        infer(client, "tiny", [binary, good[1]], ["answer"])
    r = httpx.post(service.url + "/v2/models/tiny/infer", json={"inputs": [
        {"name": "question", "shape": [1], "datatype": "BYTES", "data": ["q?"]},
        {"name": "options", "shape": [1, 1], "datatype": "BYTES", "data": ["only one"]}]})
    assert r.status_code == 422 and r.json()["error"].startswith("invalid_request: ")
    question = {"name": "question", "shape": [1], "datatype": "BYTES", "data": ["q?"]}
    options = {"name": "options", "shape": [1, 2], "datatype": "BYTES", "data": ["a", "b"]}
    for inputs, outputs, says in (
            ([question, question, options], None, r"inputs \['question'\] are given more than once"),
            ([{**question, "shape": [0], "data": []}, {**options, "shape": [0, 2], "data": []}], None,
             r"has shape \[0\]: every dimension is at least 1"),
            ([{**question, "shape": ["1"]}, options], None, "not an inference request"),  # a shape is integers
            ([{**question, "shape": [True]}, options], None, "not an inference request"),
            ([{**question, "shape": [1.5]}, options], None, "a dimension is an integer, got 1.5"),
            ([question, {**options, "data": [[[["a"]]], "b"]}], None, "nested data does not have its shape"),
            ([question, {**options, "data": [[["a"], ["b"]]]}], None, r"nested deeper than its shape \[1, 2\]"),
            ([question, options], [{"name": ["answer"]}], "not an inference request"),
            ([question, options], [{"name": "answer"}, {"name": "answer"}], "asked more than once")):
        r = httpx.post(service.url + "/v2/models/tiny/infer", timeout=60,
                       json={"inputs": inputs, **({"outputs": outputs} if outputs else {})})
        assert r.status_code == 422 and re.search(says, r.json()["error"]), (inputs, outputs, r.text)
    nested = httpx.post(service.url + "/v2/models/tiny/infer", timeout=60, json={"inputs": [
        question, {**options, "data": [["a", "b"]]}], "outputs": [{"name": "answer_index"}]})  # as its shape: fine
    assert nested.status_code == 200 and nested.json()["outputs"][0]["shape"] == [1]
    whole = httpx.post(service.url + "/v2/models/tiny/infer", timeout=60, json={"inputs": [
        {**question, "shape": [1.0]}, options], "outputs": [{"name": "answer_index"}]})  # a JSON writer's 1.0 is 1
    assert whole.status_code == 200, whole.text
    r = httpx.post(service.url + "/v2/models/tiny/infer", content=b'{"inputs": "none"}')  # untyped, as Triton sends
    assert r.status_code == 422 and r.json()["error"].startswith(
        "invalid_request: the body is not an inference request: 1 validation error for InferRequest\ninputs")


def test_infer_is_admitted_and_counted_like_predict(service):
    body = {"inputs": [{"name": "question", "shape": [1], "datatype": "BYTES", "data": [QUESTIONS[0]]},
                       {"name": "options", "shape": [1, 3], "datatype": "BYTES", "data": OPTIONS[0]}],
            "outputs": [{"name": "answer"}]}
    r = httpx.post(service.url + "/v2/models/tiny/infer", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["outputs"] == [
        {"name": "answer", "datatype": "BYTES", "shape": [1], "data": [r.json()["outputs"][0]["data"][0]]}]
    metrics = httpx.get(service.url + "/metrics").text
    assert 'route="/v2/models/{model}/infer"' in metrics
    assert httpx.get(service.url + "/v2/health/ready").json() == {"ready": True}
