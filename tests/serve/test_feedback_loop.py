"""The feedback loop closed end to end, on a real service process and its SQLite feedback store: healthy labels keep
the promises; a shift (the labels move to each answer's second choice) raises the change detector's alarm and the
version's promises are suspended in every answer; ``calibrate --dataset feedback --since-change`` writes a new
version from the labels after the change; the service serves it without a restart (SIGHUP), its own promises stand,
and nothing the alert reads is left for the violated version."""

from __future__ import annotations

import json
import random
import signal
import time

import httpx
import pytest

from tests.conftest import ServiceProcess
from tests.http_json import ok_json

KEY = "test-feedback-loop-key"
WORDS = ["sun", "moon", "water", "plant", "stone", "tree", "bird", "fish", "cloud", "river", "sand", "leaf", "rain",
         "seed", "wind", "snow"]


def questions(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"question": f"Which is {rng.choice(WORDS)}?", "options": rng.sample(WORDS, 4)} for _ in range(n)]


@pytest.fixture(scope="module")
def promising(tiny_artifact, tmp_path_factory):
    """The tiny adapter calibrated on 400 four-option questions whose label is its own top option: every answer
    right, so the calibration certifies answered accuracy 0.9 and states sets, for 4 options."""
    from ibedl.core.predictor import Predictor
    from ibedl.core.prompt import MCQuestion
    from ibedl.training.calibrate import main

    root = tmp_path_factory.mktemp("loop")
    sample = questions(400, seed=1)
    predictor = Predictor.from_artifact(tiny_artifact)
    predictor.max_tokens = 96
    predictions = predictor.predict([MCQuestion(q["question"], tuple(q["options"])) for q in sample])
    path = root / "sample.jsonl"
    path.write_text("".join(json.dumps({**q, "answer": p.index}) + "\n"
                            for q, p in zip(sample, predictions, strict=True)))
    artifact = root / "artifact"
    assert main(["--artifact", str(tiny_artifact), "--dataset", "jsonl", "--path", str(path), "--output",
                 str(artifact), "--target-accuracy", "0.9", "--max-tokens", "96", "--no-progress"]) == 0
    return artifact


def answer_all(http: httpx.Client, items: list[dict]) -> list[dict]:
    out = []
    for start in range(0, len(items), 32):
        out += ok_json(http.post("/predict/batch", json={"items": items[start:start + 32]}))["results"]
    return out


def send_labels(http: httpx.Client, answers: list[dict], pick) -> None:
    for start in range(0, len(answers), 32):
        ok_json(http.post("/v1/feedback/batch", json={"items": [
            {"receipt": a["receipt"], "label": pick(a)} for a in answers[start:start + 32]]}))


def top(answer: dict) -> str:
    return answer["prediction"]["letter"]


def second(answer: dict) -> str:
    return sorted(answer["probabilities"], key=answer["probabilities"].get, reverse=True)[1]


def accuracy_row(http: httpx.Client, version: str) -> dict:
    (row,) = [g for g in ok_json(http.get("/v1/guarantees"))["guarantees"]
              if g["guarantee"] == "answered_accuracy" and g["version"] == version]
    return row


def metric(text: str, sample: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return None


def test_healthy_shift_alarm_suspension_recalibration_and_the_new_version(promising, tmp_path):
    from ibedl.core.artifact import read_manifest
    from ibedl.training.calibrate import main as calibrate

    db = tmp_path / "feedback.sqlite"
    env = {"IBEDL_BACKEND": "torch", "IBEDL_MAX_TOKENS": "96", "IBEDL_FEEDBACK_KEY": KEY,
           "IBEDL_FEEDBACK_DB": str(db), "IBEDL_RELOAD_INTERVAL_S": "0"}
    service = ServiceProcess(promising, env, log_path=tmp_path / "service.log")
    try:
        service.wait_ready(300)
        http = httpx.Client(base_url=service.url, timeout=120, trust_env=False)
        version = str(read_manifest(promising).version)
        stated = answer_all(http, questions(1, seed=2))[0]["guarantees"]
        assert stated["holds"] and stated["answered_accuracy"] == 0.9 and stated["set_coverage"] == 0.9

        # healthy: 150 questions, each labelled with the answer given (every answered one right)
        send_labels(http, answer_all(http, questions(150, seed=3)), top)
        healthy = accuracy_row(http, version)
        assert healthy["labels"] > 100 and not healthy["violated"] and not healthy["changed"]
        assert healthy["suspended"] is None and [c["options"] for c in healthy["change"]] == [4]

        # the shift: 300 questions whose right option is the model's second choice
        send_labels(http, answer_all(http, questions(300, seed=4)), second)
        shifted = accuracy_row(http, version)
        (detector,) = shifted["change"]
        assert shifted["changed"] and detector["alarm"] and detector["statistic"] >= detector["threshold"]
        suspended = shifted["suspended"]  # by whichever stated guarantee the labels broke first
        assert suspended["by"] == "change_detector" and suspended["guarantee"] in ("answered_accuracy", "set_coverage")
        assert 150 <= suspended["change_seq"] <= 160  # where the shift began: label 151
        assert suspended["label_seq"] - suspended["change_seq"] < 60  # raised within a few dozen labels
        metrics = http.get("/metrics").text
        assert metric(metrics, f'ibedl_promises_suspended{{adapter="tiny",version="{version}"}}') == 1.0
        assert ok_json(http.get("/v1/models"))["data"][0]["promises_suspended"] == suspended
        now = answer_all(http, questions(1, seed=5))[0]
        assert now["guarantees"]["holds"] is False and now["guarantees"]["reason"] == "violated_by_feedback"
        assert now["guarantees"]["since"] == suspended["since"] and now["guarantees"]["answered_accuracy"] is None
        assert now["prediction_set_coverage"] is None

        # recalibrated on the labels after the change, in place: the next version, with its own promises
        assert calibrate(["--artifact", str(promising), "--dataset", "feedback", "--path", str(db),
                          "--since-change", "--target-accuracy", "0.9", "--no-progress"]) == 0
        newer = read_manifest(promising)
        assert str(newer.version) != version and newer.calibration["option_counts"] == [4]
        assert newer.calibration["n"] <= 300 and newer.calibration["dataset"] == "feedback"
        service.proc.send_signal(signal.SIGHUP)  # serve it now
        deadline = time.monotonic() + 60
        while ok_json(http.get("/v1/models"))["data"][0]["version"] != str(newer.version):
            assert time.monotonic() < deadline, "the recalibrated version was not served"
        assert ok_json(http.get("/v1/models"))["data"][0]["promises_suspended"] is None
        after = answer_all(http, questions(40, seed=6))
        assert {a["adapter"]["version"] for a in after} == {str(newer.version)}
        assert all(a["guarantees"]["holds"] and a["guarantees"]["reason"] is None for a in after)
        # its sets hold the new right answers: labels like the shifted ones keep its coverage promise
        send_labels(http, after, second)
        rows = [g for g in ok_json(http.get("/v1/guarantees"))["guarantees"] if g["version"] == str(newer.version)]
        assert rows and not any(g["violated"] or g["changed"] or g["suspended"] for g in rows)
        old = [g for g in ok_json(http.get("/v1/guarantees"))["guarantees"] if g["version"] == version]
        assert all(g["retired"] and not g["violated"] and g["suspended"] is None for g in old)
        assert any(g["violated_before_retired"] for g in old)  # kept for the record
        metrics = http.get("/metrics").text
        assert f'version="{version}"' not in "".join(
            line for line in metrics.splitlines() if line.startswith(("ibedl_guarantee_", "ibedl_promises_")))
        assert metric(metrics, f'ibedl_promises_suspended{{adapter="tiny",version="{newer.version}"}}') == 0.0
        # a label for an answer of the retired version no longer counts
        r = http.post("/v1/feedback", json={"receipt": now["receipt"], "label": "A"})
        assert r.status_code == 409 and r.json()["error"]["type"] == "adapter_not_served"
    finally:
        assert service.stop() == 0, service.log_text()
