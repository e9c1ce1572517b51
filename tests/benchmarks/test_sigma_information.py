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
    # Recomputed here in float64, committed from another machine. An AUROC counts ordered (test, shifted) pairs, so it
    # moves in steps of 1 / (1000 x 300) or not at all: another CPU's SIMD width and BLAS kernels move the logistic
    # fit's coefficients by < 1e-12 relative (measured between AVX-512 paths, numpy and OpenBLAS on AVX2 and on SSE
    # paths, and the committed report), far below the closest pair of scores (5e-8 relative; tied scores are questions
    # with equal features), so no pair changes order and abs 1e-9 holds. Spearman's rho is a float64 sum over the
    # ranks of at most 1,000 questions (reordering error ~1e-13): rel 1e-6 is loose for it and far below the third
    # decimal the report is read at.
    for stream, row in committed["ood"].items():
        for key, value in row.items():
            assert fresh["ood"][stream][key] == pytest.approx(value, abs=1e-9), (stream, key)
    for stream, row in committed["rank_correlation"].items():
        assert fresh["rank_correlation"][stream] == pytest.approx(row, rel=1e-6)


def test_auroc_is_the_positive_class_ranked_above():
    assert auroc([3.0, 4.0], [1.0, 2.0]) == 1.0 and auroc([1.0], [2.0]) == 0.0 and auroc([1.0], [1.0]) == 0.5
