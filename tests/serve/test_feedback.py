"""POST /v1/feedback and GET /v1/guarantees on the tiny trained artifact: receipts in answers, labels counted once,
bad inputs refused with a 4xx and nothing counted, two apps sharing one store (two replicas), the metrics; labels
only with the labelling credential (the API token gets 403), a receipt's first label standing (another is refused
and counted), the credential's quota; a retired version readable but gone from what the alert reads."""

from __future__ import annotations

import base64
import json

import pytest
from prometheus_client import generate_latest

from ibedl.engine.settings import EngineSettings
from tests.serve.conftest import wait_ready

KEY = "test-feedback-key"
API, LABEL = "test-api-token", "test-label-token"
AS_CLIENT, AS_LABELLER = {"Authorization": f"Bearer {API}"}, {"Authorization": f"Bearer {LABEL}"}
Q = {"question": "Which gas do plants take in?", "options": ["oxygen", "carbon dioxide", "nitrogen"]}


def ask(client, headers=None, **extra) -> dict:
    r = client.post("/predict", json={**Q, **extra}, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def counts(client, headers=None) -> dict:
    """Realised guarantees by name (the one adapter version), labels and hits."""
    r = client.get("/v1/guarantees", headers=headers)
    assert r.status_code == 200, r.text
    return {(g["guarantee"], g["stated"]): (g["labels"], g["hits"]) for g in r.json()["guarantees"]}


def wrong_letter(answer: dict) -> str:
    return next(k for k in answer["probabilities"] if k != answer["prediction"]["letter"])


@pytest.fixture
def feedback_client(make_client, tmp_path):
    with make_client(feedback_key=KEY, feedback_db=tmp_path / "feedback.sqlite") as c:
        yield c


def metric(text: str, sample: str) -> float | None:
    """The value of one sample (name and labels, as exposed) in a Prometheus text, None when absent."""
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return None


def with_version(artifact, tmp_path, name: str):
    """A copy of ``artifact`` as the next version of its adapter (what a new deployment serves)."""
    import shutil

    from ibedl.core.artifact import read_manifest, write_manifest

    newer = tmp_path / name
    shutil.copytree(artifact, newer)
    manifest = read_manifest(newer)
    manifest.version = str(int(manifest.version) + 1) if str(manifest.version).isdigit() else "2"
    write_manifest(newer, manifest)
    return newer, manifest.version


@pytest.fixture
def answering_artifact(tiny_artifact, tmp_path):
    """A copy of the tiny artifact that never abstains (gate and confidence threshold off), stating a certified
    target accuracy of 0.9: every answer feeds the answered accuracy."""
    import shutil

    from ibedl.core.artifact import read_manifest, write_manifest

    art = tmp_path / "answering"
    shutil.copytree(tiny_artifact, art)
    manifest = read_manifest(art)
    manifest.abstention = {**manifest.abstention, "max_uncertainty": 1.0, "min_confidence": 0.0, "ood_threshold": 0.0,
                           "how": {**manifest.abstention.get("how", {}), "target_accuracy": 0.9, "certified": True,
                                   "delta": 0.01}, "by_options": {}}
    write_manifest(art, manifest)
    return art


class TestReceipts:
    def test_answers_carry_a_receipt_only_when_feedback_is_on(self, make_client, feedback_client):
        assert ask(feedback_client)["receipt"].startswith("v1.")
        with make_client() as off:
            answer = ask(off)
            assert answer["receipt"] is None and answer["adaptive_prediction_set"] is None
            r = off.post("/v1/feedback", json={"receipt": "v1.x.y", "label": "A"})
            assert r.status_code == 404 and r.json()["error"]["type"] == "feedback_disabled"
            r = off.get("/v1/guarantees")
            assert r.status_code == 404 and r.json()["error"]["type"] == "feedback_disabled"

    def test_batch_answers_carry_distinct_receipts(self, feedback_client):
        r = feedback_client.post("/predict/batch", json={"items": [Q, Q]})
        assert r.status_code == 200
        receipts = [a["receipt"] for a in r.json()["results"]]
        assert len(set(receipts)) == 2 and all(receipts)


class TestRecording:
    def test_a_label_counts_once_and_is_scored(self, feedback_client):
        answer = ask(feedback_client, id="q-1")
        right = answer["prediction"]["letter"]
        r = feedback_client.post("/v1/feedback", json={"receipt": answer["receipt"], "label": right})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["recorded"] == 1 and body["duplicates"] == 0
        (result,) = body["results"]
        assert result["status"] == "recorded" and result["question"] == "q-1" and result["adapter"] == "tiny"
        assert result["correct"] is (None if answer["abstained"] else True)
        assert result["covered"] is (None if answer["prediction_set"] is None else right in answer["prediction_set"])
        before = counts(feedback_client)
        assert before[("answered_share", None)] == (1, 0 if answer["abstained"] else 1)
        # the same receipt again: 200, a duplicate, nothing counted
        r = feedback_client.post("/v1/feedback", json={"receipt": answer["receipt"], "label": right})
        assert r.status_code == 200 and r.json()["duplicates"] == 1 and r.json()["recorded"] == 0
        assert counts(feedback_client) == before

    def test_batch_is_all_or_nothing(self, feedback_client):
        good = ask(feedback_client)
        other = ask(feedback_client)
        r = feedback_client.post("/v1/feedback/batch", json={"items": [
            {"receipt": good["receipt"], "label": "A"}, {"receipt": other["receipt"], "label": "Z"}]})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["field"] == "items.1.label"
        assert counts(feedback_client) == {}
        r = feedback_client.post("/v1/feedback/batch", json={"items": [
            {"receipt": good["receipt"], "label": "A"}, {"receipt": other["receipt"], "label": "B"},
            {"receipt": good["receipt"], "label": "A"}]})
        assert r.status_code == 200, r.text
        assert (r.json()["recorded"], r.json()["duplicates"]) == (2, 1)
        assert counts(feedback_client)[("answered_share", None)][0] == 2

    def test_right_and_wrong_labels_move_the_accuracy(self, make_client, answering_artifact, tmp_path):
        with make_client(artifact=answering_artifact, feedback_key=KEY, feedback_db=tmp_path / "f.sqlite") as client:
            answered = [ask(client), ask(client)]
            assert not any(a["abstained"] for a in answered)
            labels = [answered[0]["prediction"]["letter"], wrong_letter(answered[1])]
            r = client.post("/v1/feedback/batch", json={"items": [
                {"receipt": a["receipt"], "label": lab} for a, lab in zip(answered, labels, strict=True)]})
            assert r.status_code == 200
            assert [x["correct"] for x in r.json()["results"]] == [True, False]
            body = client.get("/v1/guarantees").json()
        (acc,) = [g for g in body["guarantees"] if g["guarantee"] == "answered_accuracy"]
        assert acc["labels"] == 2 and acc["hits"] == 1 and acc["estimate"] == 0.5 and acc["stated"] == 0.9
        assert 0.0 <= acc["lower"] <= 0.5 <= acc["upper"] <= 1.0 and not acc["violated"]
        assert acc["served"] and not acc["retired"]
        assert body["alpha"] == EngineSettings.model_fields["guarantee_alpha"].default == 0.02
        assert body["shared_store"] is True

    def test_wrong_answers_show_the_accuracy_guarantee_violated(self, make_client, answering_artifact, tmp_path):
        """Every label contradicts the answer: the upper bound falls below the stated 0.9 after a few dozen
        labels, and the gauges say so."""
        with make_client(artifact=answering_artifact, feedback_key=KEY, feedback_db=tmp_path / "f.sqlite") as client:
            r = client.post("/predict/batch", json={"items": [Q] * 30})
            assert r.status_code == 200
            answers = r.json()["results"]
            r = client.post("/v1/feedback/batch", json={"items": [
                {"receipt": a["receipt"], "label": wrong_letter(a)} for a in answers]})
            assert r.status_code == 200 and r.json()["recorded"] == 30
            (acc,) = [g for g in client.get("/v1/guarantees").json()["guarantees"]
                      if g["guarantee"] == "answered_accuracy"]
            metrics = client.get("/metrics").text
        assert acc["hits"] == 0 and acc["upper"] < 0.9 and acc["violated"]
        assert 'ibedl_guarantee_stated{adapter="tiny",guarantee="answered_accuracy",stated="0.9"' in metrics

    def test_a_target_the_calibration_did_not_certify_is_not_tested(self, make_client, answering_artifact,
                                                                     tmp_path):
        """The answer states no accuracy when its calibration could not certify the target, so wrong labels test
        no accuracy promise and suspend nothing."""
        from ibedl.core.artifact import read_manifest, write_manifest

        manifest = read_manifest(answering_artifact)
        manifest.abstention["how"]["certified"] = False
        write_manifest(answering_artifact, manifest)
        with make_client(artifact=answering_artifact, feedback_key=KEY, feedback_db=tmp_path / "f.sqlite") as client:
            answers = client.post("/predict/batch", json={"items": [Q] * 30}).json()["results"]
            assert all(a["guarantees"]["answered_accuracy"] is None for a in answers)
            r = client.post("/v1/feedback/batch", json={"items": [
                {"receipt": a["receipt"], "label": wrong_letter(a)} for a in answers]})
            assert r.status_code == 200 and r.json()["recorded"] == 30
            tested = {g["guarantee"] for g in client.get("/v1/guarantees").json()["guarantees"]}
            after = ask(client)
        payload = json.loads(base64.urlsafe_b64decode(answers[0]["receipt"].split(".")[1] + "=="))
        assert payload["target"] is None and "answered_accuracy" not in tested
        assert after["guarantees"]["holds"] is not False


    def test_a_marginal_set_is_not_tested_against_this_calibration(self, make_client, answering_artifact, tmp_path):
        """A calibration made before PAC sets (conformal delta null) promises its sets' level over calibration
        draws: this calibration's own coverage is spread about it, so labels test no set coverage (they found it
        below 0.9 about half the time and suspended the version)."""
        from ibedl.core.artifact import read_manifest, write_manifest

        manifest = read_manifest(answering_artifact)
        manifest.conformal["delta"] = None
        write_manifest(answering_artifact, manifest)
        with make_client(artifact=answering_artifact, feedback_key=KEY, feedback_db=tmp_path / "f.sqlite") as client:
            answer = ask(client)
            assert answer["guarantees"]["set_coverage"] == 0.9 and answer["guarantees"]["set_coverage_delta"] is None
            r = client.post("/v1/feedback", json={"receipt": answer["receipt"], "label": wrong_letter(answer)})
            assert r.status_code == 200, r.text
            tested = {g["guarantee"] for g in client.get("/v1/guarantees").json()["guarantees"]}
        payload = json.loads(base64.urlsafe_b64decode(answer["receipt"].split(".")[1] + "=="))
        assert payload["coverage"] is None and "set_coverage" not in tested and "answered_share" in tested


class TestRefusals:
    def refused(self, client, body, status, type_, field="receipt"):
        before = counts(client)
        r = client.post("/v1/feedback", json=body)
        assert r.status_code == status, r.text
        assert r.json()["error"]["type"] == type_ and r.json()["error"]["field"] == field
        assert counts(client) == before

    def test_tampered_receipt(self, feedback_client):
        token = ask(feedback_client)["receipt"]
        version, payload, mac = token.split(".")
        body = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        body["options"] = 26  # claim more options than the question had
        forged = base64.urlsafe_b64encode(json.dumps(body).encode()).rstrip(b"=").decode()
        self.refused(feedback_client, {"receipt": f"{version}.{forged}.{mac}", "label": "Z"}, 422, "invalid_receipt")
        self.refused(feedback_client, {"receipt": "not a receipt", "label": "A"}, 422, "invalid_receipt")

    def test_another_keys_receipt(self, make_client, feedback_client, tmp_path):
        with make_client(feedback_key="another-feedback-key", feedback_db=tmp_path / "other.sqlite") as other:
            token = ask(other)["receipt"]
        self.refused(feedback_client, {"receipt": token, "label": "A"}, 422, "invalid_receipt")

    def test_label_outside_the_options(self, feedback_client):
        token = ask(feedback_client)["receipt"]  # three options: A..C
        self.refused(feedback_client, {"receipt": token, "label": "D"}, 422, "invalid_request", "label")
        r = feedback_client.post("/v1/feedback", json={"receipt": token, "label": "b"})  # the schema's pattern
        assert r.status_code == 422 and r.json()["error"]["field"] == "label"

    def test_expired_receipt(self, make_client, tmp_path):
        clock = {"now": 1_000_000.0}
        with make_client(feedback_key=KEY, feedback_db=tmp_path / "f.sqlite", feedback_ttl_s=60) as client:
            client.app.state.service.engine.feedback.clock = lambda: clock["now"]
            token = ask(client)["receipt"]
            clock["now"] += 61
            self.refused(client, {"receipt": token, "label": "A"}, 410, "receipt_expired")
            clock["now"] -= 2  # within its 60 s: accepted
            assert client.post("/v1/feedback", json={"receipt": token, "label": "A"}).status_code == 200

    def test_adapter_version_no_longer_served(self, make_client, tiny_artifact, tmp_path):
        db = tmp_path / "f.sqlite"
        with make_client(feedback_key=KEY, feedback_db=db) as old:
            token = ask(old)["receipt"]
        newer, _ = with_version(tiny_artifact, tmp_path, "newer")
        with make_client(feedback_key=KEY, feedback_db=db, artifact=newer) as new:
            self.refused(new, {"receipt": token, "label": "A"}, 409, "adapter_not_served")

    def test_feedback_routes_require_the_api_token(self, make_client, tmp_path):
        with make_client(feedback_key=KEY, api_token="secret") as client:
            assert client.post("/v1/feedback", json={"receipt": "x", "label": "A"}).status_code == 401
            assert client.get("/v1/guarantees").status_code == 401


class TestLabellingCredential:
    """Labels take IBEDL_LABEL_TOKEN: the API token (what every client holds) gets 403 and changes nothing."""

    @pytest.fixture
    def guarded(self, make_client, tmp_path):
        with make_client(feedback_key=KEY, feedback_db=tmp_path / "f.sqlite", api_token=API, label_token=LABEL) as c:
            yield c

    def test_the_api_token_alone_gets_403_and_changes_nothing(self, guarded):
        answer = ask(guarded, AS_CLIENT)
        label = {"receipt": answer["receipt"], "label": answer["prediction"]["letter"]}
        for path, body in (("/v1/feedback", label), ("/v1/feedback/batch", {"items": [label]})):
            r = guarded.post(path, json=body, headers=AS_CLIENT)
            assert r.status_code == 403, r.text
            error = r.json()["error"]
            assert error["type"] == "forbidden" and "IBEDL_LABEL_TOKEN" in error["message"]
            assert API not in r.text and LABEL not in r.text
        # no label stored, no metric moved
        assert counts(guarded, AS_CLIENT) == {} and guarded.app.state.service.engine.feedback.store.since(0) == []
        metrics = guarded.get("/metrics", headers=AS_CLIENT).text
        assert "ibedl_feedback_labels_total{" not in metrics and "ibedl_guarantee_labels{" not in metrics
        # the labelling credential records it, and opens nothing else
        r = guarded.post("/v1/feedback", json=label, headers=AS_LABELLER)
        assert r.status_code == 200 and r.json()["recorded"] == 1, r.text
        assert counts(guarded, AS_CLIENT)[("answered_share", None)][0] == 1
        assert guarded.post("/predict", json=Q, headers=AS_LABELLER).status_code == 401
        assert guarded.get("/v1/guarantees", headers=AS_LABELLER).status_code == 401

    def test_without_a_labelling_credential_labels_are_refused(self, make_client, tmp_path):
        with make_client(feedback_key=KEY, feedback_db=tmp_path / "f.sqlite", api_token=API) as client:
            answer = ask(client, AS_CLIENT)
            r = client.post("/v1/feedback", json={"receipt": answer["receipt"], "label": "A"}, headers=AS_CLIENT)
            assert r.status_code == 403
            assert "no labelling credential is configured. Set IBEDL_LABEL_TOKEN" in r.json()["error"]["message"]
            assert counts(client, AS_CLIENT) == {}


class TestConflicts:
    def test_a_different_label_is_refused_and_counted(self, feedback_client):
        """The first label stands: the same again is a duplicate (200), another one 409 label_conflict, counted in
        ibedl_feedback_conflicts_total; a batch holding one records none of its items."""
        answer, other = ask(feedback_client), ask(feedback_client)
        first = answer["prediction"]["letter"]
        assert feedback_client.post("/v1/feedback", json={"receipt": answer["receipt"], "label": first}).json()[
            "recorded"] == 1
        before = counts(feedback_client)
        r = feedback_client.post("/v1/feedback", json={"receipt": answer["receipt"], "label": first})
        assert r.status_code == 200 and r.json()["duplicates"] == 1
        r = feedback_client.post("/v1/feedback", json={"receipt": answer["receipt"], "label": wrong_letter(answer)})
        assert r.status_code == 409, r.text
        error = r.json()["error"]
        assert error["type"] == "label_conflict" and error["field"] == "label"
        assert "already has another label" in error["message"] and "first label" in error["message"]
        r = feedback_client.post("/v1/feedback/batch", json={"items": [
            {"receipt": other["receipt"], "label": "A"},
            {"receipt": answer["receipt"], "label": wrong_letter(answer)}]})
        assert r.status_code == 409 and r.json()["error"]["field"] == "items.1.label"
        assert "1 of the 2 items conflict; nothing was recorded" in r.json()["error"]["message"]
        assert counts(feedback_client) == before  # `other` was not recorded either
        metrics = feedback_client.get("/metrics").text
        assert metric(metrics, 'ibedl_feedback_conflicts_total{adapter="tiny"}') == 2.0
        assert feedback_client.get("/v1/guarantees").json()["conflicts"] == {"tiny": 2}  # the engine's own count
        assert metric(metrics, 'ibedl_feedback_labels_total{adapter="tiny",status="recorded"}') == 1.0
        # the first label still counts, and `other` can still be labelled
        assert feedback_client.post("/v1/feedback", json={"receipt": other["receipt"], "label": "A"}).json()[
            "recorded"] == 1

    def test_one_receipt_labelled_twice_in_one_batch(self, feedback_client):
        answer = ask(feedback_client)
        r = feedback_client.post("/v1/feedback/batch", json={"items": [
            {"receipt": answer["receipt"], "label": "A"}, {"receipt": answer["receipt"], "label": "B"}]})
        assert r.status_code == 409 and r.json()["error"]["field"] == "items.1.label"
        assert counts(feedback_client) == {}


class TestQuota:
    def test_a_credential_over_its_quota_gets_429_on_every_replica(self, make_client, tmp_path):
        db = tmp_path / "shared.sqlite"
        guard = {"feedback_key": KEY, "feedback_db": db, "label_token": LABEL, "max_labels": 2, "label_window_s": 600}
        with make_client(**guard) as one, make_client(**guard) as two:
            answers = [ask(one) for _ in range(3)]
            labels = [{"receipt": a["receipt"], "label": "A"} for a in answers]
            assert one.post("/v1/feedback", json=labels[0], headers=AS_LABELLER).status_code == 200
            assert two.post("/v1/feedback", json=labels[1], headers=AS_LABELLER).status_code == 200
            before = counts(one)
            for replica in (one, two):
                r = replica.post("/v1/feedback", json=labels[2], headers=AS_LABELLER)
                assert r.status_code == 429, r.text
                assert r.json()["error"]["type"] == "too_many_labels"
                assert "recorded 2 labels in the last 600 s" in r.json()["error"]["message"]
                assert 1 <= int(r.headers["retry-after"]) <= 600
            assert counts(one) == before
            # a duplicate is not a new label: still answered
            r = two.post("/v1/feedback", json=labels[0], headers=AS_LABELLER)
            assert r.status_code == 200 and r.json()["duplicates"] == 1
            # the window passes (the clock moves on): the label is recorded
            later = one.app.state.service.engine.feedback.clock() + 601
            one.app.state.service.engine.feedback.clock = lambda: later
            assert one.post("/v1/feedback", json=labels[2], headers=AS_LABELLER).status_code == 200


class TestRetiredVersions:
    def test_serving_a_new_version_clears_what_the_alert_reads(self, make_client, answering_artifact, tmp_path):
        """Labels show version V's accuracy guarantee broken: its answers say no promise holds from then on
        (violated_by_feedback). Once V+1 is served (a new deployment on the same store), V stays on GET
        /v1/guarantees as retired (violated_before_retired, not violated), and none of its ibedl_guarantee_* or
        ibedl_promises_suspended series is exported: the alerts read those, so only what is served can alarm."""
        db = tmp_path / "f.sqlite"
        with make_client(artifact=answering_artifact, feedback_key=KEY, feedback_db=db) as old:
            answers = old.post("/predict/batch", json={"items": [Q] * 30}).json()["results"]
            r = old.post("/v1/feedback/batch", json={"items": [
                {"receipt": a["receipt"], "label": wrong_letter(a)} for a in answers]})
            assert r.status_code == 200
            version = answers[0]["adapter"]["version"]
            (acc,) = [g for g in old.get("/v1/guarantees").json()["guarantees"]
                      if g["guarantee"] == "answered_accuracy"]
            assert acc["violated"] and acc["served"] and not acc["retired"]
            upper = (f'ibedl_guarantee_upper{{adapter="tiny",guarantee="answered_accuracy",stated="0.9",'
                     f'version="{version}"}}')
            assert metric(old.get("/metrics").text, upper) < 0.9  # what the alert reads
            assert metric(old.get("/metrics").text,
                          f'ibedl_promises_suspended{{adapter="tiny",version="{version}"}}') == 1.0
            stated = ask(old)["guarantees"]
            assert stated["holds"] is False and stated["reason"] == "violated_by_feedback"
            assert stated["since"] == acc["suspended"]["since"] and stated["answered_accuracy"] is None
        newer, new_version = with_version(answering_artifact, tmp_path, "newer")
        with make_client(artifact=newer, feedback_key=KEY, feedback_db=db) as new:
            body = new.get("/v1/guarantees").json()
            retired = [g for g in body["guarantees"] if g["version"] == version]
            assert retired and all(g["retired"] and not g["served"] for g in retired)
            (acc,) = [g for g in retired if g["guarantee"] == "answered_accuracy"]
            assert acc["labels"] == 30 and acc["violated_before_retired"]  # still readable, for the record
            assert not acc["violated"] and acc["suspended"] is None  # ... but not what alerts read
            metrics = new.get("/metrics").text
            assert "ibedl_guarantee_" not in "".join(line for line in metrics.splitlines()
                                                     if not line.startswith("#"))
            assert "ibedl_promises_suspended{" not in metrics
            assert ask(new)["guarantees"]["holds"] is True  # the new version's promises stand
            # the new version's own labels are exported as they come
            answer = ask(new)
            assert new.post("/v1/feedback", json={"receipt": answer["receipt"], "label": "A"}).status_code == 200
            metrics = new.get("/metrics").text
            assert f'version="{new_version}"' in metrics and metric(metrics, upper) is None
            assert [g["retired"] for g in new.get("/v1/guarantees").json()["guarantees"]
                    if g["version"] == new_version] == [False] * 3

    def test_the_gauges_of_a_version_that_retires_are_removed(self):
        from ibedl.serve.metrics import Metrics

        metrics = Metrics()
        g = {"adapter": "default", "version": "4", "guarantee": "answered_accuracy", "stated": 0.9, "labels": 40,
             "hits": 20, "lower": 0.3, "upper": 0.7, "retired": False}
        metrics.set_guarantees([g])
        sample = 'ibedl_guarantee_upper{adapter="default",guarantee="answered_accuracy",stated="0.9",version="4"}'
        text = lambda: generate_latest(metrics.registry).decode()  # noqa: E731
        assert metric(text(), sample) == 0.7
        metrics.set_guarantees([{**g, "retired": True}])
        assert "ibedl_guarantee_" not in "".join(line for line in text().splitlines() if not line.startswith("#"))


def test_two_replicas_sharing_a_store_count_a_label_once(make_client, tmp_path):
    """Two apps (two replicas) on one store: a label sent to the replica that did not answer is counted, the same
    label sent to either again is a duplicate, and both report the same guarantees."""
    db = tmp_path / "shared.sqlite"
    with make_client(feedback_key=KEY, feedback_db=db) as one, make_client(feedback_key=KEY, feedback_db=db) as two:
        answer = ask(one)
        r = two.post("/v1/feedback", json={"receipt": answer["receipt"], "label": "A"})
        assert r.status_code == 200 and r.json()["recorded"] == 1
        for replica in (one, two):
            r = replica.post("/v1/feedback", json={"receipt": answer["receipt"], "label": "A"})
            assert r.status_code == 200 and r.json()["duplicates"] == 1
        r = one.post("/v1/feedback", json={"receipt": answer["receipt"], "label": "B"})  # the store knows "A"
        assert r.status_code == 409 and r.json()["error"]["type"] == "label_conflict"
        assert counts(one) == counts(two) and counts(one)[("answered_share", None)][0] == 1
        metrics = two.get("/metrics").text
        assert 'ibedl_guarantee_labels{adapter="tiny",guarantee="answered_share",stated="",version=' in metrics
        assert 'ibedl_feedback_labels_total{adapter="tiny",status="recorded"} 1.0' in metrics
        assert 'ibedl_feedback_labels_total{adapter="tiny",status="duplicate"} 1.0' in metrics


def test_a_suspension_reaches_a_replica_that_records_and_is_scraped_nothing(make_client, answering_artifact,
                                                                            tmp_path):
    """Replica one records 30 wrong labels and suspends the version's promises; replica two, which receives no
    label and no scrape, says so in its own answers after its next look at the store (IBEDL_RELOAD_INTERVAL_S)."""
    import time

    db = tmp_path / "shared.sqlite"
    with make_client(artifact=answering_artifact, feedback_key=KEY, feedback_db=db) as one, \
            make_client(artifact=answering_artifact, feedback_key=KEY, feedback_db=db, reload_interval_s=0.05) as two:
        assert ask(two)["guarantees"]["holds"] is not False
        answers = one.post("/predict/batch", json={"items": [Q] * 30}).json()["results"]
        r = one.post("/v1/feedback/batch", json={"items": [
            {"receipt": a["receipt"], "label": wrong_letter(a)} for a in answers]})
        assert r.status_code == 200 and ask(one)["guarantees"]["holds"] is False
        deadline = time.monotonic() + 30
        while (answer := ask(two))["guarantees"]["holds"] is not False:
            assert time.monotonic() < deadline, "replica two never read the suspension"
    stated = answer["guarantees"]
    assert stated["reason"] == "violated_by_feedback" and stated["answered_accuracy"] is None


def test_a_replica_started_later_reads_the_labels_already_recorded(make_client, tmp_path):
    db = tmp_path / "shared.sqlite"
    with make_client(feedback_key=KEY, feedback_db=db) as first:
        answer = ask(first)
        assert first.post("/v1/feedback", json={"receipt": answer["receipt"], "label": "B"}).status_code == 200
        before = counts(first)
    with make_client(feedback_key=KEY, feedback_db=db, ready=False) as later:
        wait_ready(later)
        assert counts(later) == before


def test_adaptive_sets_follow_the_labels_and_are_reported_apart(make_client, tmp_path):
    """With IBEDL_ADAPTIVE_SETS, answers carry an adaptive set; labels outside it widen the threshold (by
    rate * (1 - alpha) each), and its coverage is reported as adaptive_set_coverage, not as set_coverage."""
    with make_client(feedback_key=KEY, feedback_db=tmp_path / "f.sqlite", adaptive_sets=True,
                     adaptive_rate=0.05) as client:
        state = client.app.state.service
        (tracker,) = state.engine.feedback._trackers.values()
        start = tracker.quantile
        answers = [ask(client) for _ in range(4)]
        assert all(a["adaptive_prediction_set"] for a in answers)
        missed = [a for a in answers if wrong_letter(a) not in a["adaptive_prediction_set"]]
        r = client.post("/v1/feedback/batch", json={"items": [
            {"receipt": a["receipt"], "label": wrong_letter(a)} for a in answers]})
        assert r.status_code == 200
        held = len(answers) - len(missed)
        assert tracker.quantile == pytest.approx(start + 0.05 * (len(missed) * 0.9 - held * 0.1))
        found = {g["guarantee"]: g for g in client.get("/v1/guarantees").json()["guarantees"]}
    assert found["adaptive_set_coverage"]["labels"] == 4 and found["adaptive_set_coverage"]["hits"] == held
    assert found["adaptive_set_coverage"]["stated"] == pytest.approx(0.9)
    assert found["set_coverage"]["labels"] == 4  # the calibrated sets' guarantee, measured apart


def test_an_adaptive_threshold_below_every_score_shows_the_top_option_and_counts_a_miss(make_client, tmp_path):
    """Right labels lower the threshold by rate * alpha each: 30 of them at rate 0.5 take it below 0, where the
    rule's set is empty. The answer then shows the most probable option alone, its receipt keeps the empty set, and
    a label on that option counts as a miss (what keeps the threshold from falling without limit)."""
    with make_client(feedback_key=KEY, feedback_db=tmp_path / "f.sqlite", adaptive_sets=True,
                     adaptive_rate=0.5) as client:
        (tracker,) = client.app.state.service.engine.feedback._trackers.values()
        answers = client.post("/predict/batch", json={"items": [Q] * 30}).json()["results"]
        assert all(a["prediction"]["letter"] in a["adaptive_prediction_set"] for a in answers)
        r = client.post("/v1/feedback/batch", json={"items": [
            {"receipt": a["receipt"], "label": a["prediction"]["letter"]} for a in answers]})
        assert r.status_code == 200 and tracker.misses == 0 and tracker.quantile < 0
        answer = ask(client)
        payload = json.loads(base64.urlsafe_b64decode(answer["receipt"].split(".")[1] + "=="))
        assert answer["adaptive_prediction_set"] == [answer["prediction"]["letter"]] and payload["adaptive_set"] == []
        r = client.post("/v1/feedback", json={"receipt": answer["receipt"], "label": answer["prediction"]["letter"]})
        assert r.status_code == 200 and tracker.misses == 1 and tracker.labels == 31
        found = {g["guarantee"]: g for g in client.get("/v1/guarantees").json()["guarantees"]}
    assert found["adaptive_set_coverage"]["labels"] == 31 and found["adaptive_set_coverage"]["hits"] == 30
