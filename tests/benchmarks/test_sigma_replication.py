"""benchmarks.sigma_replication's frozen test on questions whose sigma is built to carry information or not."""

import json

import numpy as np
import pytest

from benchmarks.decisions import SHIFTED
from benchmarks.sigma_replication import (
    ANCHOR_SEED,
    COMPARISONS,
    PAIRED,
    SEEDS,
    anchor,
    comparison,
    fit_frozen,
    frozen_gains,
    main,
    report,
    resample,
)


def features(seed: int, own: float, n_id: int = 400, n_shift: int = 200, noise: float = 0.0,
             flip: bool = False) -> dict:
    """One run's streams. log 1/u: in distribution 1 higher than shifted, plus noise; right answers more likely at
    high 1/u. Sigma: an echo of 1/u (own = 0), with a reading of its own of the shift and of being right (own > 0),
    plus independent noise (``noise``); ``flip``: on the test streams sigma's own reading points the other way.
    SciQ without passages holds as many questions as SciQ test, as the real one does."""
    rng = np.random.default_rng(seed)

    def stream(n, shifted, test):
        log_inv_u = (0.0 if shifted else 1.0) + rng.normal(size=n)
        right = (rng.random(n) < 1 / (1 + np.exp(-(log_inv_u + 1)))).astype(int)
        sign = -1.0 if flip and test else 1.0
        signal = sign * own * ((0.0 if shifted else 1.0) + (right - 0.5)) + rng.normal(size=n) * (own > 0 or noise)
        return {"inv_u": np.exp(log_inv_u), "sigma": np.exp(0.5 * log_inv_u + signal), "right": right}

    return {"sciq_validation": stream(n_id, False, False), "sciq_test": stream(n_id, False, True),
            **{f"{s}_dev": stream(n_shift, True, False) for s in SHIFTED},
            **{s: stream(n_id if s == PAIRED else n_shift, True, True) for s in SHIFTED}}


def stored(seed: int, own: float, **kw) -> dict:
    """A scores file's content (benchmarks.sigma_replication.run_scores) from :func:`features`."""
    return {"run": f"runs/s{seed}", "seed": seed, "weights_sha256": f"w{seed}",
            "streams": {n: {**{k: v.tolist() for k, v in f.items()}, "questions_sha256": f"ids-{n}-{len(f['sigma'])}"}
                        for n, f in features(seed, own, **kw).items()}}


def test_resample_draws_units_within_strata_and_pairs_together():
    a, b = np.arange(30)[:, None], 30 + np.arange(10)[:, None]
    i = resample([a, b], np.random.default_rng(0))
    assert len(i) == 40 and (i[:30] < 30).all() and (i[30:] >= 30).all()
    pairs = np.c_[np.arange(20), 20 + np.arange(20)]
    j = resample([pairs], np.random.default_rng(1))
    assert len(j) == 40 and (j[1::2] == j[::2] + 20).all()  # each question with its own passage-less copy


def test_sciq_without_passages_is_resampled_in_pairs_the_others_apart():
    f = features(0, own=1.0)
    w = fit_frozen(f["sciq_validation"], [f[f"{s}_dev"] for s in SHIFTED])
    assert [b.shape for b in comparison(f, w, PAIRED).blocks] == [(400, 2)]
    assert [b.shape for b in comparison(f, w, "obqa").blocks] == [(400, 1), (200, 1)]
    assert [b.shape for b in comparison(f, w, "right_vs_wrong").blocks] == [(400, 1)]


def test_the_combining_models_read_validation_only():
    """Every test stream replaced by other data: the frozen weights do not move, the test's values do."""
    runs = {s: stored(s, own=1.0) for s in (1, 2)}
    other = {s: {**r, "streams": {**r["streams"], **{n: stored(s + 10, own=0.0)["streams"][n]
                                                     for n in ("sciq_test", *SHIFTED)}}} for s, r in runs.items()}
    a, b = report(runs, resamples=200), report(other, resamples=200)
    assert a["frozen_weights"] == b["frozen_weights"]
    assert a["comparisons"]["obqa"]["pooled"]["value"] != b["comparisons"]["obqa"]["pooled"]["value"]
    assert a["frozen_weights"]["1"]["shift"]["log_sigma"] > 0  # sigma higher in distribution, as built


def test_a_sigma_of_its_own_replicates():
    yes = report({s: stored(s, own=1.0) for s in SEEDS}, resamples=300)
    assert set(yes["replicated"]) == set(COMPARISONS) and yes["against"] == yes["pooled_only"] == []
    assert all(g["pooled"]["value"] > 0.02 for g in yes["comparisons"].values())
    assert all(yes["comparisons"][s]["seeds_above"] == 3 for s in SHIFTED)  # on each seed alone, too
    assert yes["level_corrected"] == pytest.approx(1 - 0.05 / 7)


def test_an_echo_of_1_over_u_or_noise_does_not():
    echo = report({s: stored(s, own=0.0) for s in SEEDS}, resamples=300)
    for name, g in echo["comparisons"].items():  # sigma = sqrt(1/u): the combined score ranks as 1/u does
        if name != "partial_spearman_right":
            assert g["pooled"]["value"] == pytest.approx(0, abs=1e-12)
    noise = report({s: stored(s, own=0.0, noise=1.0) for s in SEEDS}, resamples=2000)
    assert noise["replicated"] == noise["pooled_only"] == noise["against"] == []
    assert all(g["pooled"]["ci_corrected"][0] < 0 < g["pooled"]["ci_corrected"][1]
               for g in noise["comparisons"].values())


def test_a_sigma_that_turns_on_the_test_streams_is_against():
    flipped = report({s: stored(s, own=1.0, flip=True) for s in SEEDS}, resamples=300)
    assert set(SHIFTED) <= set(flipped["against"]) and flipped["replicated"] == []


def test_the_seeds_share_their_resamples():
    """Two runs with the same features: the pooled draws equal each seed's, so do their intervals."""
    same = stored(1, own=0.5)
    out = report({1: same, 2: same}, resamples=300)["comparisons"]
    for g in out.values():
        assert g["pooled"]["ci_corrected"] == g["per_seed"]["1"]["ci_corrected"] == g["per_seed"]["2"]["ci_corrected"]


def test_the_corrected_interval_is_wider_than_the_uncorrected_one():
    out = report({s: stored(s, own=0.3) for s in (1, 2)}, resamples=400)["comparisons"]
    for g in out.values():
        low, high = g["pooled"]["ci_corrected"]
        low95, high95 = g["pooled"]["ci95"]
        assert low <= low95 <= high95 <= high and high - low > high95 - low95


def test_runs_on_other_questions_or_without_a_stream_are_refused():
    a, b = stored(1, own=1.0), stored(2, own=1.0)
    short = {**b, "streams": {n: f for n, f in b["streams"].items() if n != "obqa_dev"}}
    with pytest.raises(ValueError, match=r"seed 2's scores lack the streams \['obqa_dev'\]"):
        report({1: a, 2: short}, resamples=200)
    b["streams"]["obqa"]["questions_sha256"] = "other"
    with pytest.raises(ValueError, match="seed 2's obqa holds other questions"):
        report({1: a, 2: b}, resamples=200)
    runs = {s: {"weights": fit_frozen(f["sciq_validation"], [f[f"{x}_dev"] for x in SHIFTED]),
                "test": {n: f[n] for n in ("sciq_test", *SHIFTED)}}
            for s, f in ((1, features(1, 1.0)), (2, features(2, 1.0, n_shift=150)))}
    with pytest.raises(ValueError, match="same questions"):
        frozen_gains(runs, resamples=10)


def test_missing_runs_are_a_clear_error(tmp_path, capsys):
    assert main(["--runs", str(tmp_path / "none"), "--scores", str(tmp_path / "scores"),
                 "--output", str(tmp_path / "r.json")]) == 2
    assert "sciq_sigma_replication.yaml" in capsys.readouterr().err


def test_a_broken_scores_file_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "replication-s1.json").write_text("{not json")
    assert main(["--runs", str(tmp_path), "--scores", str(tmp_path), "--seeds", "1",
                 "--output", str(tmp_path / "r.json")]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_the_report_is_written_from_stored_scores_and_read_back(tmp_path):
    scores = tmp_path / "scores"
    scores.mkdir()
    for s in (1, 2):
        (scores / f"replication-s{s}.json").write_text(json.dumps(stored(s, own=1.0)))
    out = tmp_path / "r.json"
    assert main(["--runs", str(tmp_path / "absent"), "--scores", str(scores), "--seeds", "1", "2",
                 "--resamples", "2000", "--output", str(out), "--grid-results", str(tmp_path / "none.json")]) == 0
    result = json.loads(out.read_text())
    assert result["seeds"] == [1, 2] and result["questions"]["sciq_test"] == 400
    assert set(result["comparisons"]) == set(COMPARISONS) and set(result["frozen_weights"]) == {"1", "2"}
    assert result["runs"]["2"] == {"run": "runs/s2", "weights_sha256": "w2"}
    assert result["anchor"]["status"].startswith("not available")


def test_the_default_report_takes_the_whole_family_only(capsys):
    with pytest.raises(SystemExit):
        main(["--seeds", "1"])
    assert "read once, on the whole family" in capsys.readouterr().err


def test_too_few_resamples_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--resamples", "5"])
    assert "--resamples must be at least 2000, got 5" in capsys.readouterr().err


def test_the_anchor_is_set_beside_the_hint_s_run(tmp_path):
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps([{"seed": 1, "method": "ib_edl", "training": {}},
                                {"seed": 0, "method": "ib_edl",
                                 "training": {"validation_end": {"nll": 0.41}, "best_steps": [152]}}]))
    search = tmp_path / "search.json"
    search.write_text(json.dumps({"candidates": [{}, {}, {"run": "r", "best_step": 152,
                                                          "validation_end": {"nll": 0.40}}]}))
    got = anchor(grid, search)
    assert got["same_best_step"] and got["nll_difference"] == pytest.approx(0.01)
    assert "not available" in anchor(tmp_path / "none.json", search)["status"]


def test_the_replication_trains_the_search_s_candidate_unchanged_on_new_seeds(tmp_path):
    """benchmarks/sciq_sigma_replication.yaml's runs are sciq_sigma_search.yaml's candidate 2 (sigma rows started at
    zero, 20x rate): the same training config but for seed, output and name; the family's seeds are not the
    search's, which is trained again as the anchor."""
    import json as json_

    from benchmarks.hparam_search import candidates
    from ibedl.training.config import load_config
    from ibedl.training.experiments.benchmark import Run, expand, load_benchmark_config, train_overrides

    replication = load_benchmark_config("benchmarks/sciq_sigma_replication.yaml")
    search = load_benchmark_config("benchmarks/sciq_sigma_search.yaml")
    runs = expand(replication)
    assert [(r.method, r.kind, r.seed) for r in runs] == [("ib_edl", "id", s) for s in (ANCHOR_SEED, *SEEDS)]
    assert search["search"]["seed"] == ANCHOR_SEED not in SEEDS  # the hint's seed: the anchor, not in the family
    method, _, chosen = candidates(search)[2]
    for run in runs:
        ours = load_config(None, train_overrides(replication, run, "ib_edl", tmp_path / "r")).to_dict()
        cell = Run("search", "id", "sciq", method, run.seed, ("sciq",))
        theirs = load_config(None, [*train_overrides(search, cell, method, tmp_path / "s"),
                                    *(f"{k}={json_.dumps(v)}" for k, v in chosen.items())]).to_dict()
        assert {k: v for k, v in ours.items() if k not in ("output", "name")} == \
            {k: v for k, v in theirs.items() if k not in ("output", "name")}
        assert ours["method_params"]["sigma_init_scale"] == 0 and ours["method_params"]["sigma_lr_scale"] == 20


def test_the_committed_report_is_what_the_committed_scores_give(tmp_path):
    """benchmarks.sigma_replication recomputed from the committed per-question scores (no model run) gives the
    committed report: every decision and count equal, every number within float64 reordering error (the tolerance
    of tests/benchmarks/test_sigma_search.py, for the same arithmetic: ranks, least squares, logistic fits)."""
    from pathlib import Path

    from tests.benchmarks.test_sigma_search import REPRODUCED_ABS, REPRODUCED_REL
    from tests.reproduced import assert_reproduced

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "report.json"
    assert main(["--runs", str(tmp_path / "no-runs"), "--scores", str(root / "benchmarks/results/sigma_search_scores"),
                 "--grid-results", str(root / "benchmarks/results/sciq_sigma_replication.json"),
                 "--search", str(root / "benchmarks/results/sciq_sigma_search.json"),
                 "--output", str(out)]) == 0
    ours = json.loads(out.read_text())
    committed = json.loads((root / "benchmarks/results/sigma_replication.json").read_text())
    for record in (ours, committed):
        record.pop("command")
    assert_reproduced(ours, committed, REPRODUCED_REL, REPRODUCED_ABS)
    assert committed["seeds"] == list(SEEDS) and committed["anchor"]["same_best_step"]
