"""benchmarks.sigma_information recomputed from the committed raw outputs gives the committed report."""

import json
from pathlib import Path

import pytest

from benchmarks.sigma_information import auroc, main

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_report_is_what_the_outputs_give(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["--output", str(tmp_path / "s.json")]) == 0
    fresh, committed = (json.loads(p.read_text()) for p in (tmp_path / "s.json",
                                                            ROOT / "benchmarks/results/sigma_information.json"))
    for stream, row in committed["ood"].items():
        for key, value in row.items():
            assert fresh["ood"][stream][key] == pytest.approx(value, abs=1e-9), (stream, key)
    for stream, row in committed["rank_correlation"].items():
        assert fresh["rank_correlation"][stream] == pytest.approx(row)


def test_auroc_is_the_positive_class_ranked_above():
    assert auroc([3.0, 4.0], [1.0, 2.0]) == 1.0 and auroc([1.0], [2.0]) == 0.0 and auroc([1.0], [1.0]) == 0.5
