"""Decisions in responses: conformal prediction sets, the out-of-distribution gate and the label-free accuracy
estimate, end to end through the app on the tiny calibrated artifact."""

from __future__ import annotations

import base64
import json
import math
import shutil

import pytest

from ibedl.core.artifact import read_manifest, write_manifest
from tests.http_json import ok_json

Q = {"question": "Which is sun?", "options": ["sun", "moon", "water", "plant"], "context": "The sun is bright."}


@pytest.fixture
def open_artifact(tiny_artifact, tmp_path):
    """The tiny artifact with a rule that answers everything (so the accuracy estimate has answers to use)."""
    art = tmp_path / "open"
    shutil.copytree(tiny_artifact, art)
    m = read_manifest(art)
    thresholds_everywhere(m, min_confidence=0.0, max_uncertainty=1.0, ood_threshold=0.0)
    write_manifest(art, m)
    return art


def thresholds_everywhere(m, **values) -> None:
    """Set abstention thresholds at the top level and in every option count's own calibration (the tiny artifact is
    calibrated per count: 3, 4 and 5 options)."""
    m.abstention.update(values)
    for entry in m.abstention.get("by_options", {}).values():
        entry.update({k: v for k, v in values.items() if k in ("min_confidence", "ood_threshold")})


class TestPredictionSets:
    def test_default_set_follows_the_stored_quantile(self, client, tiny_artifact):
        body = ok_json(client.post("/predict", json=Q))
        conformal = read_manifest(tiny_artifact).conformal_sets()
        assert body["prediction_set_coverage"] == pytest.approx(1 - conformal.alpha)
        assert body["prediction_set_score"] == conformal.score
        # The expected set from the definitions (ibedl/core/conformal.py's docstring), written out here rather than
        # by the function the service calls: options ranked by probability, LAC score 1 - p, APS score the mass
        # ranked above plus half its own; the set is every option scoring at most the stored quantile, most probable
        # first, and the top option when none does.
        probs = [body["probabilities"][k] for k in "ABCD"]
        ranked = sorted(range(4), key=lambda i: -probs[i])
        above = {i: sum(probs[j] for j in ranked[:r]) for r, i in enumerate(ranked)}
        score = {i: 1 - probs[i] if conformal.score == "lac" else above[i] + probs[i] / 2 for i in range(4)}
        expected = ["ABCD"[i] for i in ranked if score[i] <= conformal.quantile() + 1e-9] or ["ABCD"[ranked[0]]]
        assert body["prediction_set"] == expected
        assert body["prediction_set"][0] == body["prediction"]["letter"]

    @pytest.mark.parametrize("score", ["lac", "aps"])
    def test_smaller_alpha_gives_a_superset(self, client, score):
        sets = [ok_json(client.post("/predict", json={**Q, "conformal": {"alpha": a, "score": score}}))
                for a in (0.2, 0.1, 0.01)]
        assert [s["prediction_set_coverage"] for s in sets] == pytest.approx([0.8, 0.9, 0.99])
        assert set(sets[0]["prediction_set"]) <= set(sets[1]["prediction_set"]) <= set(sets[2]["prediction_set"])

    def test_alpha_not_stored_is_a_422_naming_the_stored_ones(self, client):
        r = client.post("/predict", json={**Q, "conformal": {"alpha": 0.3}})
        assert r.status_code == 422
        err = r.json()["error"]
        assert err["field"] == "conformal" and "0.01, 0.02, 0.05, 0.1, 0.2" in err["message"]
        r = client.post("/predict/batch", json={"items": [Q, {**Q, "conformal": {"alpha": 0.3}}]})
        assert r.status_code == 422 and r.json()["error"]["field"] == "items.1.conformal"

    @pytest.mark.parametrize("bad", [{"alpha": 0}, {"alpha": 1}, {"score": "raps"}, {"alpha": "0.1x"}])
    def test_malformed_conformal_options_are_422(self, client, bad):
        assert client.post("/predict", json={**Q, "conformal": bad}).status_code == 422

    def test_uncalibrated_adapter_answers_null_sets(self, uncalibrated_artifact, make_client):
        with make_client(artifact=uncalibrated_artifact) as c:
            body = ok_json(c.post("/predict", json=Q))
            assert body["prediction_set"] is None and body["prediction_set_coverage"] is None
            r = c.post("/predict", json={**Q, "conformal": {"alpha": 0.1}})
            assert r.status_code == 422 and "ibedl.training.calibrate" in r.json()["error"]["message"]


class TestGate:
    def test_ood_score_is_inverse_uncertainty(self, client):
        body = ok_json(client.post("/predict", json=Q))
        assert body["ood_score"] == pytest.approx(1 / body["uncertainty_mass"], rel=1e-5)

    @pytest.mark.parametrize("threshold, reason", [(1e9, "out_of_distribution"), (0.0, None)])
    def test_gate_abstains_below_its_threshold(self, open_artifact, make_client, threshold, reason):
        m = read_manifest(open_artifact)
        thresholds_everywhere(m, ood_threshold=threshold)
        write_manifest(open_artifact, m)
        with make_client(artifact=open_artifact) as c:
            body = ok_json(c.post("/predict", json=Q))
            assert body["abstain_reason"] == reason and body["abstained"] == (reason is not None)
            # the set is still there: a user may show it instead of an answer
            assert body["prediction_set"]


class TestAccuracyEstimate:
    def test_estimate_is_the_mean_confidence_of_answered_questions(self, open_artifact, make_client):
        with make_client(artifact=open_artifact) as c:
            before = ok_json(c.get("/v1/drift"))
            assert before["answered_in_window"] == 0 and before["estimated_accuracy"] is None
            confs = []
            for i in range(5):
                body = ok_json(c.post("/predict", json={**Q, "question": f"Which is sun? ({i})"}))
                assert not body["abstained"]
                confs.append(body["confidence"])
            d = ok_json(c.get("/v1/drift"))
            mean = sum(confs) / 5
            half = 1.959964 * math.sqrt(sum(p * (1 - p) for p in confs)) / 5
            assert d["answered_in_window"] == 5
            assert d["estimated_accuracy"] == pytest.approx(mean, abs=1e-5)
            assert d["estimated_accuracy_interval"] == pytest.approx([max(0, mean - half), min(1, mean + half)],
                                                                     abs=1e-5)
            how = read_manifest(open_artifact).abstention["how"]
            assert d["target_accuracy"] == (how["target_accuracy"] if how["certified"] else None)
            metrics = c.get("/metrics").text
            assert 'ibedl_estimated_accuracy_window{adapter="tiny"} 5.0' in metrics
            shown = "NaN" if d["target_accuracy"] is None else d["target_accuracy"]
            assert f'ibedl_target_accuracy{{adapter="tiny"}} {shown}' in metrics

    def test_a_target_the_calibration_could_not_certify_is_no_target(self, open_artifact, make_client):
        """Its answers state no accuracy (answered_accuracy null), so the drift status and the gauge the alert
        compares with state none either (they said the uncertified target)."""
        m = read_manifest(open_artifact)
        for how in (m.abstention["how"], *(e["how"] for e in m.abstention.get("by_options", {}).values())):
            how["certified"] = False
        write_manifest(open_artifact, m)
        with make_client(artifact=open_artifact) as c:
            body = ok_json(c.post("/predict", json=Q))
            assert body["guarantees"]["answered_accuracy"] is None
            assert ok_json(c.get("/v1/drift"))["target_accuracy"] is None
            assert 'ibedl_target_accuracy{adapter="tiny"} NaN' in c.get("/metrics").text

    def test_a_request_with_its_own_thresholds_is_promised_no_accuracy(self, open_artifact, make_client, tmp_path):
        """Learn-then-Test certified the adapter's threshold: a request's higher one answers other questions, whose
        accuracy nothing bounds (it need not rise with the threshold), so its answer states none and its receipt
        carries no target its label would test. Its set's coverage still holds; a request that tightens nothing is
        promised the target."""
        m = read_manifest(open_artifact)
        for how in (m.abstention["how"], *(e["how"] for e in m.abstention.get("by_options", {}).values())):
            how.update(certified=True, target_accuracy=0.9, delta=0.1)
        write_manifest(open_artifact, m)
        with make_client(artifact=open_artifact, feedback_key="k" * 32, feedback_db=tmp_path / "f.sqlite") as c:
            for abstain, target in ((None, 0.9), ({"min_confidence": 0.0, "max_uncertainty": 1.0}, 0.9),
                                    ({"min_confidence": 0.99}, None), ({"max_uncertainty": 0.5}, None)):
                body = ok_json(c.post("/predict", json={**Q, "abstain": abstain}))
                assert body["guarantees"]["answered_accuracy"] == target, abstain
                assert body["guarantees"]["holds"] is True and body["guarantees"]["set_coverage"] == 0.9
                payload = json.loads(base64.urlsafe_b64decode(body["receipt"].split(".")[1] + "=="))
                assert payload["target"] == target and payload["coverage"] == 0.9

    def test_without_a_dirichlet_a_requests_max_uncertainty_changes_nothing_and_keeps_the_promise(
            self, tiny_map_artifact, make_client, tmp_path):
        """A softmax head has no u to abstain on: max_uncertainty decides nothing there, so the answer keeps its
        promised accuracy (only min_confidence above the adapter's drops it)."""
        art = tmp_path / "map"
        shutil.copytree(tiny_map_artifact, art)
        m = read_manifest(art)
        thresholds_everywhere(m, min_confidence=0.0, max_uncertainty=1.0, ood_threshold=0.0)
        for how in (m.abstention["how"], *(e["how"] for e in m.abstention.get("by_options", {}).values())):
            how.update(certified=True, target_accuracy=0.9, delta=0.1)
        write_manifest(art, m)
        with make_client(artifact=art) as c:
            for abstain, target in (({"max_uncertainty": 0.1}, 0.9), ({"min_confidence": 0.99}, None)):
                body = ok_json(c.post("/predict", json={**Q, "abstain": abstain}))
                assert body["uncertainty_mass"] is None and body["guarantees"]["answered_accuracy"] == target, abstain

    def test_abstained_questions_do_not_count(self, open_artifact, make_client):
        with make_client(artifact=open_artifact) as c:
            c.post("/predict", json={**Q, "abstain": {"min_confidence": 1.0}})
            assert ok_json(c.get("/v1/drift"))["answered_in_window"] == 0


def test_models_list_the_stored_sets_and_calibration(client):
    card = ok_json(client.get("/v1/models"))["data"][0]
    assert card["conformal"]["alphas"] == [0.01, 0.02, 0.05, 0.1, 0.2]
    assert card["conformal"]["scores"] == ["aps", "lac"]
    assert card["calibration"]["risk_control"]["target_accuracy"] == card["abstention"]["how"]["target_accuracy"]
    assert card["abstention"]["ood_score"] == "inverse_uncertainty"


def test_openapi_documents_the_new_fields(client):
    schemas = ok_json(client.get("/openapi.json"))["components"]["schemas"]
    response = schemas["PredictResponse"]["properties"]
    for key in ("prediction_set", "prediction_set_coverage", "prediction_set_score", "ood_score", "abstain_reason"):
        assert "description" in response[key], key
    assert "conformal" in schemas["PredictRequest"]["properties"]
    assert {"conformal", "calibration", "abstention"} <= set(schemas["ModelCard"]["properties"])
    assert "estimated_accuracy" in schemas["DriftStatus"]["properties"]
