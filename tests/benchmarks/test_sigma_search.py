"""benchmarks.sigma_search's statistics on questions whose sigma is built to carry information or not."""

import numpy as np
import pytest

from benchmarks.decisions import SHIFTED
from benchmarks.sigma_search import average_ranks, fast_auroc, gain, main, partial_spearman, score_candidate
from tests.reproduced import assert_reproduced, mismatches


def test_partial_spearman_removes_what_the_given_variable_explains():
    rng = np.random.default_rng(0)
    given = rng.normal(size=2000)
    a = given + 0.1 * rng.normal(size=2000)  # both follow `given`: correlated, but not beyond it
    b = given + 0.1 * rng.normal(size=2000)
    assert abs(partial_spearman(a, b, given)) < 0.06
    own = rng.normal(size=2000)  # a signal of their own, shared
    assert partial_spearman(a + own, b + own, given) > 0.8


@pytest.mark.parametrize("values", [[3.0], [2.0, 2.0, 2.0], [1.0, 2.0, 3.0], [3.0, 1.0, 3.0, 2.0, 1.0, 3.0],
                                    [0.5, -np.inf, 0.5, np.inf, -0.0, 0.0]])
def test_average_ranks_are_scipys(values):
    from scipy.stats import rankdata

    x = np.asarray(values)
    assert np.array_equal(average_ranks(x), rankdata(x))
    many = np.round(np.random.default_rng(0).normal(size=997), 1)  # runs of ties of every length
    assert np.array_equal(average_ranks(many), rankdata(many))


def test_fast_auroc_is_sklearns_with_ties():
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(3)
    y = (rng.random(500) < 0.3).astype(float)
    score = np.round(rng.normal(size=500) + y, 1)  # rounded: many ties
    assert fast_auroc(y, score) == pytest.approx(roc_auc_score(y, score), abs=1e-12)


def test_gain_is_positive_only_when_sigma_carries_a_signal_of_its_own():
    rng = np.random.default_rng(1)
    y = np.r_[np.ones(400), np.zeros(400)]
    log_inv_u = y + rng.normal(size=800)  # 1/u separates the classes in part
    echo = np.c_[log_inv_u, 0.5 * log_inv_u]  # sigma a function of 1/u: nothing to add
    no = gain(echo, y)
    assert abs(no["gain"]) < 0.01 and not no["sigma_adds"]
    assert no["auroc_inv_u"] == pytest.approx(0.76, abs=0.04)  # Phi(1 / sqrt(2)) for unit shift and noise
    own = np.c_[log_inv_u, y + rng.normal(size=800)]  # sigma an independent reading of the class
    yes = gain(own, y)
    assert yes["gain"] > 0.05 and yes["sigma_adds"] and yes["gain_ci95"][0] > 0


def test_score_candidate_reads_every_stream():
    rng = np.random.default_rng(2)

    def stream(n, shift):
        inv_u = np.exp(rng.normal(shift, 1, n))
        return {"inv_u": inv_u, "sigma": inv_u ** 0.5, "alpha0": 4 * inv_u}

    feats = {"sciq_validation": stream(300, 1.0), **{f"{s}_dev": stream(100, 0.0) for s in SHIFTED}}
    hits = (rng.random(300) < 0.8).astype(float)
    record = score_candidate(feats, hits)
    assert set(record["ood"]) == set(SHIFTED)
    assert all(v == pytest.approx(1.0) for v in record["spearman_sigma_inv_u"].values())  # sigma = sqrt(1/u)
    assert all(not o["sigma_adds"] and o["auroc_sigma"] == pytest.approx(o["auroc_inv_u"], abs=0.01)
               for o in record["ood"].values())
    assert record["accuracy"] == pytest.approx(hits.mean())


def test_a_missing_search_is_a_clear_error(tmp_path, capsys):
    assert main(["--search", str(tmp_path / "none.json")]) == 2
    assert "hparam_search" in capsys.readouterr().err


# The report is float64 arithmetic over at most 1,000 questions: ranks, least-squares residuals (partial Spearman),
# logistic fits (scikit-learn's lbfgs) and pair counts (AUROC). Another CPU's SIMD width and BLAS kernels reorder
# its sums, which moves the last bits (measured: up to 6e-17 between this repository's AVX-512 machine and the
# committed report, 13 numbers of the partial Spearman; the same with numpy and OpenBLAS on AVX2 code paths); the
# bound n * eps ~ 2e-13 of a reordered sum of 1,000 terms is far below 1e-9, and 1e-9 is far below the third decimal
# the report is read at. Counts, booleans (sigma_adds) and names must be equal.
REPRODUCED_REL, REPRODUCED_ABS = 1e-9, 1e-12


def test_the_committed_report_is_what_the_committed_scores_give(tmp_path):
    """benchmarks.sigma_search recomputed from the committed per-question scores (no model run) gives the committed
    report: every conclusion and count equal, every number within float64 reordering error."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "report.json"
    assert main(["--search", str(root / "benchmarks/results/sciq_sigma_search.json"), "--output", str(out),
                 "--scores", str(root / "benchmarks/results/sigma_search_scores")]) == 0
    ours, committed = json.loads(out.read_text()), json.loads((root / "benchmarks/results/sciq_sigma_information.json")
                                                              .read_text())
    for record in (ours, committed):
        record.pop("command"), record.pop("search")
    assert_reproduced(ours, committed, REPRODUCED_REL, REPRODUCED_ABS)
    assert committed["questions"]["sciq_validation"] == 1000 and committed["split"] == "validation only"


def test_a_reproduction_differs_where_a_conclusion_or_a_number_beyond_the_tolerance_does():
    committed = {"gain": 0.003, "sigma_adds": False, "questions": 300, "ci95": [-0.0008, 0.0073]}
    assert mismatches({**committed, "gain": 0.003 + 6e-17}, committed, REPRODUCED_REL, REPRODUCED_ABS) == []
    assert mismatches({**committed, "gain": 0.0031}, committed, REPRODUCED_REL, REPRODUCED_ABS) == [
        "/gain: 0.0031 != 0.003"]
    assert mismatches({**committed, "sigma_adds": True}, committed, REPRODUCED_REL, REPRODUCED_ABS) == [
        "/sigma_adds: True != False"]
    assert mismatches({**committed, "questions": 299}, committed, REPRODUCED_REL, REPRODUCED_ABS) == [
        "/questions: 299 != 300"]
    assert mismatches({**committed, "ci95": [-0.0008]}, committed, REPRODUCED_REL, REPRODUCED_ABS) == [
        "/ci95: 1 items against 2"]


def test_a_scores_file_s_right_answers_are_its_sciq_validation_stream_s(tmp_path):
    """Files scored now keep each stream's right answers (no separate "hits"); older files' "hits" still read."""
    import json

    from benchmarks.sigma_search import candidate_features

    c = {"run": "runs/x/ib_edl-0", "overrides": {"a": 1}}
    streams = {"sciq_validation": {"inv_u": [1.0, 2.0], "sigma": [0.5, 0.6], "right": [1, 0]}}
    (tmp_path / "ib_edl-0.json").write_text(json.dumps({**c, "streams": streams}))
    assert candidate_features(c, None, 8, tmp_path)[1].tolist() == [1.0, 0.0]
    (tmp_path / "ib_edl-0.json").write_text(json.dumps({**c, "streams": streams, "hits": [0, 1]}))
    assert candidate_features(c, None, 8, tmp_path)[1].tolist() == [0.0, 1.0]
