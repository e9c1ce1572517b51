"""Per option count: an adapter calibrated per count answers each count with its own gate, threshold and set, and
says so; a count it was never calibrated for gets the statement that no guarantee holds."""

from __future__ import annotations

import copy
import shutil

import pytest

from ibedl.core.artifact import read_manifest, write_manifest
from tests.http_json import ok_json


@pytest.fixture
def per_count(tiny_artifact, tmp_path):
    """The tiny artifact as if calibrated per count for 2..5 options: 2-option questions abstain below confidence
    0.999 (target 0.95) and get every option in their set; the others keep the top level."""
    art = tmp_path / "per-count"
    shutil.copytree(tiny_artifact, art)
    m = read_manifest(art)
    how = {**m.abstention["how"], "certified": True, "target_accuracy": 0.95, "delta": 0.01}
    m.abstention["by_options"] = {
        "2": {"ood_threshold": 0.0, "min_confidence": 0.999, "how": how},
        **{str(c): {"ood_threshold": m.abstention["ood_threshold"], "min_confidence": m.abstention["min_confidence"],
                    "how": m.abstention["how"]} for c in (3, 4, 5)}}
    everything = {s: {a: None for a in q} for s, q in m.conformal["quantiles"].items()}  # +inf: every option
    m.conformal["by_options"] = {"2": {"quantiles": everything, "n": 150},
                                 **{str(c): {"quantiles": copy.deepcopy(m.conformal["quantiles"]),
                                             "n": m.conformal["n"]} for c in (3, 4, 5)}}
    m.calibration["option_counts"] = [2, 3, 4, 5]
    write_manifest(art, m)
    return art


def test_each_count_is_answered_under_its_own_calibration(make_client, per_count):
    with make_client(artifact=per_count) as c:
        two = ok_json(c.post("/predict", json={"question": "Which is it?", "options": ["sun", "moon"]}))
        four = ok_json(c.post("/predict", json={"question": "Which is it?",
                                                "options": ["sun", "moon", "tree", "bird"]}))
        six = ok_json(c.post("/predict", json={"question": "Which?", "options": ["a", "b", "c", "d", "e", "f"]}))
        card = c.get("/v1/models").json()["data"][0]
    assert card["calibrated_option_counts"] == [2, 3, 4, 5]
    # two options: its own threshold (nothing the tiny model says reaches 0.999) and set (every option)
    assert two["abstain_reason"] == "min_confidence" and sorted(two["prediction_set"]) == ["A", "B"]
    assert two["guarantees"]["holds"] and two["guarantees"]["answered_accuracy"] == 0.95
    assert four["guarantees"]["holds"] and four["guarantees"]["answered_accuracy"] != 0.95  # the top level's
    assert six["guarantees"] == {**six["guarantees"], "holds": False, "option_counts": [2, 3, 4, 5]}


def test_a_bad_per_count_entry_is_refused_at_load(per_count):
    from ibedl.core.artifact import ArtifactError, check_artifact

    m = read_manifest(per_count)
    m.abstention["by_options"]["1"] = m.abstention["by_options"]["2"]
    with pytest.raises(ArtifactError, match="by_options keys are option counts 2..26 as strings, got '1'"):
        write_manifest(per_count, m)
        check_artifact(per_count)


def test_labels_of_a_count_never_calibrated_test_no_guarantee(make_client, per_count, tmp_path):
    with make_client(artifact=per_count, feedback_key="test-feedback-key", feedback_db=tmp_path / "f.sqlite") as c:
        six = ok_json(c.post("/predict", json={"question": "Which?", "options": ["a", "b", "c", "d", "e", "f"]}))
        three = ok_json(c.post("/predict", json={"question": "Which?", "options": ["sun", "moon", "tree"]}))
        for answer in (six, three):
            ok_json(c.post("/v1/feedback", json={"receipt": answer["receipt"], "label": "A"}))
        series = [(g["guarantee"], g["stated"]) for g in ok_json(c.get("/v1/guarantees"))["guarantees"]]
        rows = {g["guarantee"]: g["labels"] for g in ok_json(c.get("/v1/guarantees"))["guarantees"]}
        metrics = c.get("/metrics").text
    assert six["prediction_set"] and six["prediction_set_coverage"] is None  # a set, no level stated
    assert rows["answered_share"] == 2  # both are counted as traffic
    assert rows["set_coverage"] == 1  # only the 3-option answer tests the stated coverage
    assert [s for g, s in series if g != "answered_share"] == [s for g, s in series if g != "answered_share" and s]
    assert 'guarantee="set_coverage",stated=""' not in metrics  # no series of no level beside the stated one's
    assert rows.get("answered_accuracy", 0) == (0 if three["abstained"] else 1)


def test_a_gate_states_its_refusal_rate_where_it_holds(make_client, per_count):
    """A count whose gate has a threshold and a stated training-conditional rate says it (with its delta); one
    without a gate (threshold 0) states none."""
    m = read_manifest(per_count)
    m.abstention["by_options"]["3"].update(ood_threshold=1e-9, how={
        **m.abstention["by_options"]["3"]["how"], "gate_rejection_rate": 0.15, "delta": 0.01})
    m.abstention["by_options"]["2"]["how"] = {**m.abstention["by_options"]["2"]["how"], "gate_rejection_rate": 0.15}
    write_manifest(per_count, m)
    with make_client(artifact=per_count) as c:
        three = ok_json(c.post("/predict", json={"question": "Which?", "options": ["sun", "moon", "tree"]}))
        two = ok_json(c.post("/predict", json={"question": "Which is it?", "options": ["sun", "moon"]}))
    assert three["guarantees"]["gate_refusal_rate"] == 0.15 and three["guarantees"]["gate_refusal_delta"] == 0.01
    assert two["guarantees"]["gate_refusal_rate"] is None  # no gate for 2 options: nothing refused, nothing stated
