"""benchmarks/decisions.py analyse: served decisions recomputed from stored raw outputs, on a synthetic dump of
the tiny artifact (in-distribution streams confident, shifted streams diffuse)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from benchmarks.decisions import SHIFTED, main, paired_auroc_difference
from ibedl.core.artifact import read_manifest, write_manifest
from ibedl.training.calibrate import CalibrationConfig, calibrate_outputs, save_outputs


def stream(rng, n, sharp):
    labels, alphas, sigmas = [], [], []
    for _ in range(n):
        c = int(rng.integers(3, 6))
        y = int(rng.integers(c))
        alpha = 1.0 + rng.gamma(1.0, 1.0, size=c)
        if sharp:
            alpha[y if rng.random() < 0.97 else (y + 1) % c] += rng.gamma(6.0, 5.0)
        labels.append(y), alphas.append(list(alpha)), sigmas.append(list(rng.uniform(0.01, 0.1, size=c)))
    return {"labels": labels, "alpha": alphas, "sigma": sigmas,
            "probs": [list(np.asarray(a) / sum(a)) for a in alphas]}


@pytest.fixture
def setup(tiny_artifact, tmp_path):
    rng = np.random.default_rng(0)
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    streams = {"sciq_validation": stream(rng, 600, True), "sciq_test": stream(rng, 400, True)}
    streams.update({name: stream(rng, 100, False) for name in SHIFTED})
    streams["obqa_dev"] = stream(rng, 50, False)
    # Calibrate the artifact on the dump's validation stream, as ibedl.training.calibrate --outputs would.
    manifest = read_manifest(art)
    raw = {**streams["sciq_validation"], "offset": 1.0}
    head_update, _, sections = calibrate_outputs("ib_edl", raw, raw["labels"], CalibrationConfig())
    manifest.head.update(head_update)
    for key, value in sections.items():
        setattr(manifest, key, value)
    manifest.calibration.update(dataset="sciq", split="validation", limit=None)
    write_manifest(art, manifest)
    scores = tmp_path / "scores"
    save_outputs(scores / "tiny.json", art, manifest, streams, "ib_edl", 1.0, 1024)
    return art, scores, streams, manifest


def test_analyse_reports_what_the_service_would_decide(setup, tmp_path):
    art, scores, streams, manifest = setup
    out = tmp_path / "decisions.json"
    assert main(["analyse", "--adapter", f"tiny={art}", "--scores-dir", str(scores), "--splits", "100",
                 "--output", str(out)]) == 0
    report = json.loads(out.read_text())["adapters"]["tiny"]
    assert out.with_suffix(".png").is_file()
    # The answered share of a shifted stream follows the service's rule, written out here (ibedl.engine.abstention):
    # answer when the OOD score 1/u (u = C / alpha0) reaches the gate, u <= max_uncertainty and max p >=
    # min_confidence.
    s = streams["obqa"]
    limits = manifest.abstention
    assert limits["ood_score"] == "inverse_uncertainty"
    answered = []
    for a, p in zip(s["alpha"], s["probs"], strict=True):
        u = len(a) / sum(a)
        answered.append((limits["ood_threshold"] <= 0 or 1 / u >= limits["ood_threshold"])
                        and u <= limits["max_uncertainty"] and max(p) >= limits["min_confidence"])
    assert report["streams"]["obqa"]["answered"] == pytest.approx(np.mean(answered))
    assert report["dev_streams"]["obqa"]["n"] == 50
    # IB-EDL's sigma per stream: each question's mean over its options, summarised.
    per_question = np.array([np.mean(q) for q in s["sigma"]])
    q1, q3 = np.percentile(per_question, [25, 75])
    expected = {"median": np.median(per_question), "iqr": q3 - q1, "cv": per_question.std() / per_question.mean()}
    assert report["streams"]["obqa"]["sigma"] == pytest.approx(expected, rel=1e-4)  # the dump rounds to 6 digits
    # Diffuse shifted streams are mostly refused; confident in-distribution ones mostly answered.
    assert report["streams"]["sciq_test"]["answered"] > 0.8
    assert report["max_answered_shifted"] < 0.2
    assert report["manifest_check"]["checked"]
    assert report["manifest_check"]["min_confidence"][0] == pytest.approx(report["manifest_check"]["min_confidence"][1])
    splits = report["repeated_splits"]
    assert splits["splits"] == 100
    for score in ("lac", "aps"):
        assert splits["sets"][score]["mean_coverage"] >= 0.9 - 0.02
    assert splits["risk"]["share_of_splits_guarantee_held"] >= 0.8


def test_scores_of_other_weights_are_refused(setup, tmp_path):
    art, scores, _, _ = setup
    (art / "head.safetensors").write_bytes((art / "head.safetensors").read_bytes() + b" ")
    with pytest.raises(SystemExit, match="other weights"):
        main(["analyse", "--adapter", f"tiny={art}", "--scores-dir", str(scores), "--output", str(tmp_path / "x.json")])


def test_too_few_splits_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        main(["analyse", "--adapter", "a=b", "--splits", "10"])
    assert "--splits must be >= 100" in capsys.readouterr().err


def test_paired_auroc_difference_against_sklearn_and_its_interval():
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(3)
    a_in, a_out = rng.normal(1.0, 1.0, 300), rng.normal(0.0, 1.0, 200)  # a separates the streams
    b_in, b_out = a_in + rng.normal(0, 3.0, 300), a_out + rng.normal(0, 3.0, 200)  # b: the same, blurred
    r = paired_auroc_difference(a_in, a_out, b_in, b_out, resamples=500)
    auc = lambda i, o: roc_auc_score(np.r_[np.ones(len(i)), np.zeros(len(o))], np.r_[i, o])  # noqa: E731
    assert r["difference"] == pytest.approx(auc(a_in, a_out) - auc(b_in, b_out))
    assert 0 < r["interval"][0] < r["difference"] < r["interval"][1] and r["verdict"] == "a higher"
    same = paired_auroc_difference(a_in, a_out, a_in, a_out, resamples=200)  # paired: no spread at all
    assert same["difference"] == 0 and same["interval"] == [0, 0] and same["verdict"] == "cannot tell"
    with pytest.raises(ValueError, match="not of the same questions"):
        paired_auroc_difference(a_in, a_out, b_in[:10], b_out)


def test_compare_refuses_adapters_that_answered_other_questions(setup, tmp_path):
    art, scores, streams, manifest = setup
    other = {k: {**v, "labels": [(y + 1) % 3 for y in v["labels"]]} if k == "obqa" else v for k, v in streams.items()}
    save_outputs(scores / "other.json", art, manifest, other, "ib_edl", 1.0, 1024)
    with pytest.raises(SystemExit, match="did not answer the same obqa questions"):
        main(["compare", "--adapter", f"tiny={art}", "--against", f"other={art}", "--scores-dir", str(scores),
              "--output", str(tmp_path / "c.json")])
    out = tmp_path / "same.json"
    assert main(["compare", "--adapter", f"tiny={art}", "--against", f"tiny={art}", "--scores-dir", str(scores),
                 "--resamples", "100", "--output", str(out)]) == 0
    assert {r["verdict"] for r in json.loads(out.read_text())["streams"].values()} == {"cannot tell"}
