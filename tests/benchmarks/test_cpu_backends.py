"""benchmarks.cpu_backends judges a backend under its own calibration: made from its validation outputs with the
artifact's settings, it is the calibration the artifact stores for that backend (the same code, sample and seed),
and the test-side figures are those of that calibration's decisions."""

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.cpu_backends import decisions, peak_of
from ibedl.core.artifact import read_manifest

ROOT = Path(__file__).resolve().parents[2]
SCORES = ROOT / "benchmarks" / "results" / "decision_scores"


@pytest.mark.parametrize(("key", "file"), [("torch-fp32", "default-torch-options.json"),
                                           ("openvino-fp32", "default-openvino-fp32-options.json"),
                                           ("openvino-bf16", "default-openvino-bf16-options.json"),
                                           ("openvino-int8", "default-openvino-int8-options.json")])
def test_a_backend_is_judged_under_the_calibration_stored_for_it(key, file):
    manifest = read_manifest(ROOT / "artifacts" / "default")
    dump = json.loads((SCORES / file).read_text())
    val = {**dump["streams"]["sciq_validation"], "offset": dump["offset"]}
    test = {k: (v[:200] if isinstance(v, list) else v) for k, v in val.items()}  # any labelled outputs will do
    row = decisions(manifest, key, dump["kind"], val, test, splits=20)
    stored = manifest.calibration_for(key)
    assert row["calibration"]["min_confidence"] == stored.thresholds.min_confidence
    assert row["calibration"]["ood_threshold"] == stored.thresholds.ood_threshold
    assert row["calibration"]["stored_in_artifact"] == {"min_confidence": stored.thresholds.min_confidence,
                                                        "ood_threshold": stored.thresholds.ood_threshold}
    # the test figures are those of the stored calibration's decisions on those questions: IB-EDL's post-hoc map
    # alpha <- max(alpha - zeta sigma, 1) with the stored zeta, then p = alpha / alpha0 and 1/u = alpha0 / C
    assert set(stored.head) == {"zeta"} and row["calibration"]["head"] == stored.head
    zeta = stored.head["zeta"]
    alphas = [np.maximum(np.asarray(a) - zeta * np.asarray(s), 1.0)
              for a, s in zip(test["alpha"], test["sigma"], strict=True)]
    hits = np.asarray([np.argmax(a) == y for a, y in zip(alphas, test["labels"], strict=True)])
    assert row["test"]["accuracy"] == pytest.approx(hits.mean())
    inv_u = np.asarray([np.sum(a) / len(a) for a in alphas])
    conf = np.asarray([np.max(a) / np.sum(a) for a in alphas])
    limits = [stored.thresholds.for_options(len(a)) for a in alphas]  # each count's own, as served
    answered = np.asarray([u >= t.ood_threshold and c >= t.min_confidence
                           for u, c, t in zip(inv_u, conf, limits, strict=True)])
    assert row["test"]["answered"] == pytest.approx(answered.mean())
    assert row["test"]["answered_accuracy"] == pytest.approx(hits[answered].mean())
    assert row["repeated_splits"]["splits"] == 20 and 0 <= row["repeated_splits"]["risk"][
        "share_of_splits_guarantee_held"] <= 1


def test_each_backend_is_measured_against_the_peak_of_its_precision():
    peak = {"fp32": 100.0, "bf16": 300.0, "int8": 600.0}
    assert peak_of("torch", peak) == ("fp32", 100.0)
    assert peak_of("openvino-fp32", peak) == ("fp32", 100.0)
    assert peak_of("openvino", peak) == ("fp32", 100.0)  # int8 weights, fp32 compute
    assert peak_of("openvino-bf16", peak) == ("bf16", 300.0)
    assert peak_of("openvino-int8", peak) == ("int8", 600.0)


def test_through_the_service_each_backend_is_a_ratio_to_torch_and_a_fraction_of_its_peak():
    from benchmarks.cpu_backends import service_summary

    measured = {"torch": {"single_s": [0.2] * 9 + [1.0], "batch_s": [1.6, 1.6], "batch_sizes": [8, 8]},
                "openvino-int8": {"single_s": [0.1] * 8 + [0.12, 0.5], "batch_s": [0.4, 0.4], "batch_sizes": [8, 8],
                                  "non_200": 0},
                "openvino": {"skipped": "no calibration"},
                "openvino-bf16": {"single_s": [0.1] * 10, "batch_s": [0.8, 0.8], "batch_sizes": [8, 8], "non_200": 1}}
    rows = service_summary(measured, {"fp32": 100.0, "int8": 400.0}, gflop_per_question=10.0)
    assert rows["openvino"] == {"skipped": "no calibration"}
    assert rows["torch"]["batch_questions_per_s"] == 16 / 3.2
    assert rows["openvino-int8"]["single_p50_speedup_vs_torch"] == 2.0
    assert rows["openvino-int8"]["batch_throughput_vs_torch"] == 4.0
    assert rows["torch"]["fraction_of_own_peak_at_single_p50"] == 10.0 / 0.2 / 100.0
    assert rows["openvino-int8"]["precision"] == "int8"
    assert rows["openvino-int8"]["fraction_of_own_peak_at_single_p50"] == 10.0 / 0.1 / 400.0
    assert rows["openvino-int8"]["non_200"] == 0 and "single_s" not in rows["openvino-int8"]
    assert rows["openvino-int8"]["seconds"]["single"] == measured["openvino-int8"]["single_s"]
    # torch's mean time over int8's, paired question by question: 0.28 / 0.142, inside its interval
    single = rows["openvino-int8"]["single_mean_speedup_vs_torch"]
    assert single["ratio"] == pytest.approx(0.28 / 0.142) and single["low"] <= single["ratio"] <= single["high"]
    assert rows["openvino-int8"]["batch_mean_speedup_vs_torch"]["ratio"] == pytest.approx(4.0)
    assert "single_mean_speedup_vs_torch" not in rows["torch"]
    # a refused request's time is not an answer's: no paired speed-up where either side refused one
    assert rows["openvino-bf16"]["single_mean_speedup_vs_torch"] is None
    assert rows["openvino-bf16"]["batch_mean_speedup_vs_torch"] is None
