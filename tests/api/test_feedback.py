"""Feedback through the Python API and the batch command: answers carry receipts, labels are recorded once into
the store the service shares, bad labels are refused with nothing recorded, and a recalibration reads them."""

from __future__ import annotations

import json

import pytest

import ibedl
from ibedl.batch import main as batch_main
from ibedl.engine.errors import FeedbackDisabled, InvalidReceipt, InvalidRequest, LabelConflict

KEY = "api-feedback-key"
QUESTIONS = [
    {"question": "Which is sun?", "options": ["sun", "moon", "tree"], "id": "a"},
    {"question": "Which is bird?", "options": ["fish", "bird", "cloud", "river"], "id": "b"},
]


def shares(model) -> tuple[int, int]:
    (g,) = [g for g in model.guarantees().guarantees if g.guarantee == "answered_share"]
    return g.labels, g.hits


def test_api_records_feedback_once_and_refuses_bad_labels(tiny_artifact, tmp_path):
    model = ibedl.load(tiny_artifact, max_tokens=96, feedback_key=KEY, feedback_db=tmp_path / "f.sqlite")
    answers = model.predict(QUESTIONS)
    assert all(a.receipt for a in answers)
    with pytest.raises(InvalidRequest) as e:  # "D" is not an option of the first question: nothing recorded
        model.record_feedback([{"receipt": answers[1].receipt, "label": "D"}, {"receipt": answers[0].receipt,
                                                                              "label": "D"}])
    assert e.value.field == "items.1.label"
    with pytest.raises(InvalidReceipt):
        model.record_feedback([{"receipt": answers[0].receipt[:-3] + "xyz", "label": "A"}])
    off = ibedl.load(tiny_artifact, max_tokens=96)  # no key: no receipts, no feedback
    assert off.predict(QUESTIONS[:1])[0].receipt is None
    with pytest.raises(FeedbackDisabled):
        off.guarantees()
    with pytest.raises(FeedbackDisabled):
        off.record_feedback([{"receipt": answers[0].receipt, "label": "A"}])
    response = model.record_feedback([{"receipt": a.receipt, "label": "A"} for a in answers])
    assert (response.recorded, response.duplicates) == (2, 0)
    assert [r.question for r in response.results] == ["a", "b"]
    again = model.record_feedback([{"receipt": answers[0].receipt, "label": "A"}])
    assert (again.recorded, again.duplicates) == (0, 1)
    with pytest.raises(LabelConflict) as e:  # a receipt keeps its first label, as over HTTP (no credential here)
        model.record_feedback([{"receipt": answers[1].receipt, "label": "B"}])
    assert e.value.type == "label_conflict" and e.value.field == "items.0.label"
    assert model.guarantees().conflicts == {"tiny": 1}  # counted on this door too
    assert shares(model)[0] == 2
    assert not any(g.retired for g in model.guarantees().guarantees)

    # a second Model on the same store (another process, or the service) sees the same labels
    other = ibedl.load(tiny_artifact, max_tokens=96, feedback_key=KEY, feedback_db=tmp_path / "f.sqlite")
    assert shares(other) == shares(model)


def test_batch_scores_with_receipts_and_records_labels(tiny_artifact, tmp_path, monkeypatch):
    monkeypatch.setenv("IBEDL_FEEDBACK_KEY", KEY)
    monkeypatch.setenv("IBEDL_FEEDBACK_DB", str(tmp_path / "f.sqlite"))
    monkeypatch.setenv("IBEDL_MAX_TOKENS", "96")
    questions, answers = tmp_path / "q.jsonl", tmp_path / "a.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    assert batch_main(["--artifact", str(tiny_artifact), "--input", str(questions), "--output", str(answers),
                       "--no-progress"]) == 0
    receipts = [json.loads(line)["receipt"] for line in answers.read_text().splitlines()]
    assert all(receipts)

    labels, recorded = tmp_path / "labels.jsonl", tmp_path / "recorded.jsonl"
    labels.write_text("\n".join([
        json.dumps({"receipt": receipts[0], "label": "A"}),
        "not json",
        json.dumps({"receipt": receipts[1], "label": "F"}),  # four options: A..D
        json.dumps({"receipt": receipts[1], "label": "B"}),
        json.dumps({"receipt": receipts[0], "label": "A"}),  # again: a duplicate
    ]) + "\n")
    assert batch_main(["--artifact", str(tiny_artifact), "--feedback", str(labels), "--output", str(recorded)]) == 0
    out = [json.loads(line) for line in recorded.read_text().splitlines()]
    assert [r.get("status") or r["error"]["type"] for r in out] == [
        "recorded", "invalid_json", "invalid_request", "recorded", "duplicate"]
    assert [r["line"] for r in out] == [1, 2, 3, 4, 5]
    model = ibedl.load(tiny_artifact)  # the same env: the same store
    assert shares(model)[0] == 2


def test_batch_feedback_needs_a_key_and_a_store(tiny_artifact, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("IBEDL_FEEDBACK_KEY", raising=False)
    labels = tmp_path / "labels.jsonl"
    labels.write_text("{}\n")
    assert batch_main(["--artifact", str(tiny_artifact), "--feedback", str(labels), "--output",
                       str(tmp_path / "o.jsonl")]) == 2
    assert "IBEDL_FEEDBACK_KEY" in capsys.readouterr().err
