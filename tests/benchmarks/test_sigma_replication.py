"""benchmarks.sigma_replication's frozen test on questions whose sigma is built to carry information or not."""

import json

import numpy as np
import pytest

from benchmarks.decisions import SHIFTED
from benchmarks.sigma_replication import COMPARISONS, fit_frozen, frozen_gains, main, report, resample


def synthetic(seed: int, own: float, n_id: int = 400, n_shift: int = 200) -> dict:
    """One run's streams. log 1/u: in distribution 1 higher than shifted, plus noise; right answers more likely at
    high 1/u. Sigma: an echo of 1/u (own = 0), or with a reading of its own of the shift and of being right
    (own > 0). Test streams hold the same number of questions for every seed, as the real ones do."""
    rng = np.random.default_rng(seed)

    def stream(n, shifted):
        log_inv_u = (0.0 if shifted else 1.0) + rng.normal(size=n)
        right = (rng.random(n) < 1 / (1 + np.exp(-(log_inv_u + 1)))).astype(int)
        signal = own * ((0.0 if shifted else 1.0) + (right - 0.5)) + rng.normal(size=n) * (own > 0)
        return {"inv_u": np.exp(log_inv_u), "sigma": np.exp(0.5 * log_inv_u + signal), "right": right}

    return {"sciq_validation": stream(n_id, False), "sciq_test": stream(n_id, False),
            **{f"{s}_dev": stream(n_shift, True) for s in SHIFTED}, **{s: stream(n_shift, True) for s in SHIFTED}}


def test_resample_keeps_each_stratum_s_size_and_members():
    strata = np.r_[np.zeros(30, int), np.ones(10, int)]
    i = resample(strata, np.random.default_rng(0))
    assert len(i) == 40 and (strata[i[:30]] == 0).all() and (strata[i[30:]] == 1).all()


def test_the_combining_models_read_validation_only():
    feats = synthetic(0, own=1.0)
    w = fit_frozen(feats["sciq_validation"], [feats[f"{s}_dev"] for s in SHIFTED])
    moved = {**feats, "sciq_test": {k: v[::-1] for k, v in feats["sciq_test"].items()}}  # other test data
    again = fit_frozen(moved["sciq_validation"], [moved[f"{s}_dev"] for s in SHIFTED])
    assert np.array_equal(w["shift"], again["shift"]) and np.array_equal(w["right"], again["right"])
    assert w["shift"][1] > 0  # sigma higher in distribution, as built


def test_a_sigma_of_its_own_replicates_and_an_echo_does_not():
    yes = report({s: synthetic(s, own=1.0) for s in (1, 2, 3)}, resamples=300)
    assert set(yes["replicated"]) == set(COMPARISONS) and yes["against"] == []
    assert all(g["pooled"]["gain"] > 0.02 for g in yes["comparisons"].values())
    assert all(yes["comparisons"][s]["seeds_above"] == 3 for s in SHIFTED)  # on each seed alone, too
    assert yes["comparisons"]["right_vs_wrong"]["seeds_above"] >= 1  # fewer wrong answers: wider per seed
    no = report({s: synthetic(s, own=0.0) for s in (1, 2, 3)}, resamples=300)
    # sigma = sqrt(1/u): the combined score ranks as 1/u does (a positive weight on it), so every gain is 0
    assert no["replicated"] == [] and no["against"] == []
    for g in no["comparisons"].values():
        assert g["pooled"]["gain"] == pytest.approx(0, abs=1e-12)
    assert no["level_corrected"] == pytest.approx(1 - 0.05 / 6)


def test_the_corrected_interval_is_wider_than_the_uncorrected_one():
    runs = {s: synthetic(s, own=0.3) for s in (1, 2)}
    out = report(runs, resamples=400)["comparisons"]
    for g in out.values():
        low, high = g["pooled"]["ci_corrected"]
        low95, high95 = g["pooled"]["ci95"]
        assert low <= low95 <= high95 <= high and high - low > high95 - low95


def test_runs_whose_test_streams_differ_are_refused():
    a, b = synthetic(1, own=1.0), synthetic(2, own=1.0, n_shift=150)
    runs = {s: {"weights": fit_frozen(f["sciq_validation"], [f[f"{x}_dev"] for x in SHIFTED]),
                "test": {n: f[n] for n in ("sciq_test", *SHIFTED)}} for s, f in ((1, a), (2, b))}
    with pytest.raises(ValueError, match="same questions"):
        frozen_gains(runs, resamples=10)


def test_missing_runs_are_a_clear_error(tmp_path, capsys):
    assert main(["--runs", str(tmp_path / "none"), "--scores", str(tmp_path / "scores"), "--seeds", "1"]) == 2
    assert "sciq_sigma_replication.yaml" in capsys.readouterr().err


def test_the_report_is_written_from_stored_scores_and_read_back(tmp_path):
    scores = tmp_path / "scores"
    scores.mkdir()
    for s in (1, 2):
        streams = {n: {k: v.tolist() for k, v in f.items()} for n, f in synthetic(s, own=1.0).items()}
        (scores / f"replication-s{s}.json").write_text(json.dumps({"seed": s, "streams": streams}))
    out = tmp_path / "r.json"
    assert main(["--runs", str(tmp_path / "absent"), "--scores", str(scores), "--seeds", "1", "2",
                 "--resamples", "200", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["seeds"] == [1, 2] and result["questions"]["sciq_test"] == 400
    assert set(result["comparisons"]) == set(COMPARISONS) and set(result["frozen_weights"]) == {"1", "2"}


def test_too_few_resamples_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--resamples", "5"])
    assert "--resamples must be at least 100, got 5" in capsys.readouterr().err


def test_the_replication_trains_the_search_s_candidate_unchanged_on_new_seeds(tmp_path):
    """benchmarks/sciq_sigma_replication.yaml's runs are sciq_sigma_search.yaml's candidate 2 (sigma rows started at
    zero, 20x rate) on seeds other than the search's: the same training config but for seed, output and name."""
    import json as json_

    from benchmarks.hparam_search import candidates
    from ibedl.training.config import load_config
    from ibedl.training.experiments.benchmark import Run, expand, load_benchmark_config, train_overrides

    replication = load_benchmark_config("benchmarks/sciq_sigma_replication.yaml")
    search = load_benchmark_config("benchmarks/sciq_sigma_search.yaml")
    runs = expand(replication)
    assert [(r.method, r.kind, r.seed) for r in runs] == [("ib_edl", "id", s) for s in (1, 2, 3)]
    assert search["search"]["seed"] not in {r.seed for r in runs}  # the hint's seed is not reused
    method, _, chosen = candidates(search)[2]
    for run in runs:
        ours = load_config(None, train_overrides(replication, run, "ib_edl", tmp_path / "r")).to_dict()
        cell = Run("search", "id", "sciq", method, run.seed, ("sciq",))
        theirs = load_config(None, [*train_overrides(search, cell, method, tmp_path / "s"),
                                    *(f"{k}={json_.dumps(v)}" for k, v in chosen.items())]).to_dict()
        assert {k: v for k, v in ours.items() if k not in ("output", "name")} == \
            {k: v for k, v in theirs.items() if k not in ("output", "name")}
        assert ours["method_params"]["sigma_init_scale"] == 0 and ours["method_params"]["sigma_lr_scale"] == 20
