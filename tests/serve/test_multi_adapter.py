"""Several adapters on one shared base model (IBEDL_ARTIFACTS): choosing one per request, listing them, metrics
by adapter, and answers identical to those of each adapter served alone."""

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.http_json import ok_json
from tests.serve.conftest import load_error, wait_status

Q = {"question": "Which is sun?", "options": ["sun", "moon", "tree"], "id": "q1"}
QUESTIONS = [{"question": f"Which is {w}?", "options": [w, "stone", "bird", "fish"], "id": f"q{i}"}
             for i, w in enumerate(["sun", "moon", "water", "plant", "cloud", "river"])]


@pytest.fixture
def multi(make_client, tiny_artifact, tiny_map_artifact):
    with make_client(artifacts=f"{tiny_artifact},{tiny_map_artifact}") as c:
        yield c


def test_models_lists_every_adapter_and_requests_pick_one(multi):
    cards = ok_json(multi.get("/v1/models"))["data"]
    assert [(m["id"], m["method"]) for m in cards] == [("tiny", "ib_edl"), ("tiny-map", "map")]
    default = ok_json(multi.post("/predict", json=Q))
    assert default["adapter"]["name"] == "tiny" and default["uncertainty_mass"] is not None
    chosen = ok_json(multi.post("/predict", json={**Q, "adapter": "tiny-map"}))
    assert chosen["adapter"] == {"name": "tiny-map", "method": "map", "version": "1", "backend": "torch",
                                 "calibration": "torch-fp32"}
    assert chosen["uncertainty_mass"] is None and chosen["belief_masses"] is None  # softmax head: no Dirichlet
    assert ok_json(multi.post("/predict", json={**Q, "adapter": "tiny"})) == default


def test_unknown_adapter_is_422_naming_the_served_ones(multi):
    r = multi.post("/predict", json={**Q, "adapter": "nope"})
    assert r.status_code == 422
    assert r.json()["error"]["field"] == "adapter" and "['tiny', 'tiny-map']" in r.json()["error"]["message"]
    r = multi.post("/predict/batch", json={"items": [Q, {**Q, "adapter": "nope"}]})
    assert r.status_code == 422 and r.json()["error"]["field"] == "items.1.adapter"
    r = multi.post("/predict/batch", json={"items": [Q, {**Q, "adapter": "tiny-map"}]})
    assert r.status_code == 422 and "one adapter" in r.json()["error"]["message"]
    assert multi.get("/v1/drift", params={"adapter": "nope"}).status_code == 422
    schema = ok_json(multi.get("/openapi.json"))["components"]["schemas"]["PredictRequest"]["properties"]["adapter"]
    assert {"type": "string", "maxLength": 128, "enum": ["tiny", "tiny-map"]} in schema["anyOf"]


def test_answers_equal_each_adapter_served_alone(make_client, multi, tiny_artifact, tiny_map_artifact):
    """Requests for both adapters sent at once (queued together, so passes alternate and the model switches
    adapters between them) get the answers each adapter gives when it is the only one loaded."""
    names = ["tiny", "tiny-map"] * len(QUESTIONS)
    bodies = [{**q, "adapter": name} for q in QUESTIONS for name in ("tiny", "tiny-map")]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda b: ok_json(multi.post("/predict", json=b)), bodies))
    for artifact, name in ((tiny_artifact, "tiny"), (tiny_map_artifact, "tiny-map")):
        with make_client(artifact=artifact) as alone:
            expected = [ok_json(alone.post("/predict", json=q)) for q in QUESTIONS]
        got = [a for a, n in zip(together, names, strict=True) if n == name]
        assert [g["adapter"]["name"] for g in got] == [name] * len(QUESTIONS)
        for g, e in zip(got, expected, strict=True):
            assert g["probabilities"] == pytest.approx(e["probabilities"], abs=2e-6)
            assert g["prediction"] == e["prediction"] and g["abstained"] == e["abstained"]


def test_metrics_and_drift_by_adapter(multi):
    words = ["sun", "moon", "tree", "fish", "stone", "bird"]
    watched = {name: ok_json(multi.get("/v1/drift", params={"adapter": name}))["options"]
               for name in ("tiny", "tiny-map")}
    assert set(watched.values()) <= {3, 4, 5}  # per count (min_per_count 10): the main count's answers alone
    for _ in range(2):
        multi.post("/predict", json={**Q, "options": words[:watched["tiny-map"]], "adapter": "tiny-map"})
    multi.post("/predict", json={**Q, "options": words[:watched["tiny"]]})
    multi.post("/predict", json={**Q, "options": words[:6]})  # a count the reference does not hold: not in drift
    text = multi.get("/metrics").text
    assert 'ibedl_answers_total{adapter="tiny"} 2.0' in text
    assert 'ibedl_answers_total{adapter="tiny-map"} 2.0' in text
    assert 'ibedl_confidence_count{adapter="tiny-map"} 2.0' in text
    assert 'ibedl_drift_window{adapter="tiny-map"} 2.0' in text and 'ibedl_drift_window{adapter="tiny"} 1.0' in text
    assert 'ibedl_model_info{adapter="tiny-map",' in text
    assert ok_json(multi.get("/v1/drift", params={"adapter": "tiny-map"}))["statistic"] == "confidence"
    assert ok_json(multi.get("/v1/drift"))["statistic"] == "uncertainty_mass"


def test_adapters_of_different_base_models_are_refused(make_client, tiny_artifact, tiny_map_artifact, tmp_path,
                                                       caplog):
    other = tmp_path / "other-base"
    shutil.copytree(tiny_map_artifact, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["base_model"]["sha256"] = "0" * 64
    (other / "manifest.json").write_text(json.dumps(manifest))
    with make_client(artifacts=f"{tiny_artifact},{other}", ready=False) as c:
        body = wait_status(c, "failed")
        error = load_error(caplog, body)
        assert error.startswith("BaseModelMismatchError: ") and "share one base model" in error
        assert "BaseModelMismatchError" in body["reason"] and str(tmp_path) not in body["reason"]


def test_two_adapters_of_one_name_are_refused(make_client, tiny_artifact, tmp_path, caplog):
    twin = tmp_path / "twin"
    shutil.copytree(tiny_artifact, twin)
    with make_client(artifacts=f"{tiny_artifact},{twin}", ready=False) as c:
        body = wait_status(c, "failed")
        assert "two adapters are named 'tiny'" in load_error(caplog, body)
