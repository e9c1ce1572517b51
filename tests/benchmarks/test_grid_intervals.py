import re

import numpy as np
import pytest
from scipy import stats
from sklearn.metrics import roc_auc_score

from benchmarks.grid_intervals import against, claim_interval, over_confidence, over_seeds, resampled_auroc, verdict
from benchmarks.grid_predictions import SEP, GridPredictions, beside, padded, tagged
from benchmarks.paper_comparison import Claim, head_to_head
from ibedl.training import metrics
from ibedl.training.experiments.benchmark import Run
from tests.benchmarks.test_paired_bootstrap import sharpen

IB0 = "ib_edl:no_posthoc"


def calibrated(n: int, rng, options: int = 4) -> tuple[np.ndarray, np.ndarray]:
    probs = rng.dirichlet(np.full(options, 0.4), size=n)
    labels = np.array([rng.choice(options, p=p) for p in probs])
    return probs, labels


def put(arrays: dict, train: str, method: str, dataset: str, probs, labels, u=None, probs0=None) -> None:
    key = SEP.join((train, method, dataset)) + SEP
    arrays[key + "probs"] = padded(list(probs))
    arrays[key + "labels"] = np.asarray(labels, dtype=np.int8)
    if u is not None:
        arrays[key + "uncertainty"] = np.asarray(u, dtype=np.float32)
    if probs0 is not None:
        arrays[key + "probs0"] = padded(list(probs0))
        arrays[key + "uncertainty0"] = np.asarray(u, dtype=np.float32)


def test_resampled_auroc_on_the_identity_is_sklearns():
    rng = np.random.default_rng(0)
    pos, neg = rng.normal(1, 1, 300), np.round(rng.normal(0, 1, 200), 1)  # ties across the classes
    got = resampled_auroc(pos, neg, np.arange(300)[None, :], np.arange(200)[None, :])[0]
    want = roc_auc_score(np.r_[np.ones(300), np.zeros(200)], np.r_[pos, neg])
    assert got == pytest.approx(want, abs=1e-12)
    assert got == pytest.approx(metrics.auroc(pos, neg), abs=1e-12)


@pytest.mark.parametrize(("low", "high", "point", "better", "want"), [
    (-0.05, -0.01, -0.03, "lower", "holds"), (-0.05, 0.01, -0.02, "lower", "direction"), (0.01, 0.05, 0.03, "lower",
    "no"), (0.01, 0.05, 0.03, "higher", "holds"), (-0.4, 0.6, 0.1, "no_worse", "holds"),
    (0.5, 2.5, 1.4, "no_worse", "holds"), (-1.4, 0.6, -0.4, "no_worse", "direction"),
    (-3.0, -1.5, -2.0, "no_worse", "no")])
def test_verdicts(low, high, point, better, want):
    claim = Claim("x", "id", ("ib_edl", "ece"), (("map", "ece"),), 1, better, 1.0 if better == "no_worse" else 0.0)
    assert verdict(claim, low, high, point) == want


@pytest.mark.parametrize(("low", "high", "better", "want"), [
    (0.01, 0.05, "lower", True), (-0.01, 0.05, "lower", False), (-0.05, -0.01, "higher", True),
    (-0.05, 0.01, "higher", False), (-3.0, -1.5, "no_worse", True), (-3.0, -0.5, "no_worse", False)])
def test_an_interval_wholly_on_the_other_side_speaks_against_the_claim(low, high, better, want):
    claim = Claim("x", "id", ("ib_edl", "ece"), (("map", "ece"),), 1, better, 1.0 if better == "no_worse" else 0.0)
    assert against(claim, low, high) is want


def grid(seeds=(0, 1, 2), n: int = 600, shift: bool = False):
    """IB-EDL calibrated (at zeta 0), MAP over-confident (sharpened), on the same questions on every seed."""
    rng = np.random.default_rng(42)
    probs, labels = calibrated(n, rng)
    arrays, runs = {}, []
    for seed in seeds:
        noise = np.random.default_rng(seed)
        jitter = np.clip(probs + noise.normal(0, 0.01, probs.shape), 1e-4, None)
        jitter /= jitter.sum(1, keepdims=True)
        u = 1 - jitter.max(1)
        put(arrays, f"sciq-ib_edl-s{seed}", "ib_edl", "sciq", sharpen(jitter, 0.7), labels, u, probs0=jitter)
        put(arrays, f"sciq-map-s{seed}", "map", "sciq", sharpen(jitter, 0.5), labels)
        runs.append(Run("id", "id", "sciq", "map", seed, ("sciq",)))
        if shift:  # the shifted stream: IB-EDL's u high, MAP's confidence as in distribution
            odd, odd_labels = calibrated(400, np.random.default_rng(100))  # the same questions each seed
            put(arrays, f"sciq-ib_edl-s{seed}", "ib_edl", "obqa", odd, odd_labels, 0.9 + 0.1 * noise.random(400),
                probs0=odd)
            put(arrays, f"sciq-map-s{seed}", "map", "obqa", sharpen(jitter[:400], 0.5), labels[:400])
            runs.append(Run("ood", "ood", "sciq", "map", seed, ("sciq", "obqa")))
    return GridPredictions(arrays), runs


def test_a_clear_calibration_gap_holds_on_every_seed_and_pooled():
    preds, runs = grid()
    claim = Claim("ECE", "id", (IB0, "ece"), (("map", "ece"),), 100, "lower")
    got = claim_interval(claim, runs, preds, resamples=400)
    assert got["seeds"] == 3 and got["held_on"] == 3
    low, high = got["pooled"]["ci95"]
    assert low < got["pooled"]["difference"] < high < 0
    truth = [100 * (metrics.ece(preds.get(f"sciq-ib_edl-s{s}", "ib_edl", "sciq", bare=True)["probs"],
                                preds.get(f"sciq-map-s{s}", "map", "sciq")["labels"])
                    - metrics.ece(preds.get(f"sciq-map-s{s}", "map", "sciq")["probs"],
                                  preds.get(f"sciq-map-s{s}", "map", "sciq")["labels"])) for s in range(3)]
    assert got["pooled"]["difference"] == pytest.approx(np.mean(truth), abs=1e-4)


def test_the_interval_over_seeds_combines_students_t_on_the_seeds_and_the_normal_on_the_questions():
    preds, runs = grid()
    claim = Claim("ECE", "id", (IB0, "ece"), (("map", "ece"),), 100, "lower")
    got = claim_interval(claim, runs, preds, resamples=200)
    diffs = [got["per_seed"][s]["difference"] for s in range(3)]
    low, high = got["over_seeds"]["ci95"]
    # wider than the seeds' spread alone (Student's t on their differences) by the questions' sampling error
    t_only = stats.t.interval(0.95, 2, loc=np.mean(diffs), scale=stats.sem(diffs))
    assert low < t_only[0] and high > t_only[1]
    assert got["over_seeds"]["difference"] == pytest.approx(got["pooled"]["difference"], abs=1e-9)
    assert "over_seeds" not in claim_interval(claim, runs[:1], preds, resamples=200)  # one seed: no spread to show
    # the closed form: half-width sqrt((t s / sqrt(n))^2 + (z sqrt(v))^2)
    sem = stats.sem([1.0, 2.0, 3.0, 4.0])
    half = np.sqrt((stats.t.ppf(0.975, 3) * sem) ** 2 + (stats.norm.ppf(0.975) * 0.5) ** 2)
    assert over_seeds(claim, [1.0, 2.0, 3.0, 4.0], 0.25)["ci95"] == pytest.approx([2.5 - half, 2.5 + half])
    no_questions = stats.t.interval(0.95, 3, loc=2.5, scale=sem)  # the seeds' error alone: Student's t, n - 1
    assert over_seeds(claim, [1.0, 2.0, 3.0, 4.0], 0.0)["ci95"] == pytest.approx(list(no_questions), rel=1e-12)


@pytest.mark.parametrize(("question_sd", "seed_sd", "seeds"), [(1.0, 1.5, 4), (1.0, 0.3, 4), (0.3, 1.5, 3),
                                                               (1.0, 1.5, 2), (0.0, 1.5, 4), (1.0, 0.0, 3)])
def test_the_interval_over_seeds_covers_the_expected_difference_at_least_95_percent_of_the_time(
        question_sd, seed_sd, seeds):
    """Coverage over draws, as the interval is stated: each draw a test set (its sampling error shared by the seeds,
    its variance known to the interval) and ``seeds`` seeds around it; true difference -2; 2,000 draws. Exact where
    one error is absent, wide where both are."""
    claim = Claim("acc", "id", (IB0, "accuracy"), (("map", "accuracy"),), 100, "higher")
    rng = np.random.default_rng(0)
    covered = np.mean([low <= -2.0 <= high for low, high in
                       (over_seeds(claim, list(-2.0 + rng.normal(0, question_sd) + rng.normal(0, seed_sd, seeds)),
                                   question_sd**2)["ci95"] for _ in range(2000))])
    assert 0.935 <= covered <= (0.965 if 0.0 in (question_sd, seed_sd) else 0.99)  # binomial sd at 95%: 0.5 points


def test_equal_differences_on_the_seeds_keep_the_questions_error_and_bad_input_is_refused():
    claim = Claim("acc", "id", (IB0, "accuracy"), (("map", "accuracy"),), 100, "higher")
    tied = over_seeds(claim, [0.6, 0.6], 0.04)  # not a point: the questions' normal interval
    assert tied["ci95"] == pytest.approx([0.6 - 1.959964 * 0.2, 0.6 + 1.959964 * 0.2])
    assert tied["verdict"] == "holds"
    with pytest.raises(ValueError, match="must be finite"):
        over_seeds(claim, [1.0, float("nan")], 0.1)
    for variance in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="must be finite"):
            over_seeds(claim, [1.0, 2.0], variance)
    assert over_seeds(claim, [1.0], 0.1) is None  # one seed: no spread to show


def test_a_no_worse_claim_over_seeds_holds_within_its_tolerance():
    par = Claim("par", "id", (IB0, "accuracy"), (("map", "accuracy"),), 100, "no_worse", 1.0)
    assert over_seeds(par, [-0.2, 0.1, 0.0, -0.1], 0.01)["verdict"] == "holds"  # wholly above -1 point
    low_side = over_seeds(par, [-3.0, -2.5, -2.8, -3.1], 0.01)
    assert low_side["verdict"] == "no" and low_side["against"]


def test_identical_rows_do_not_hold_and_a_no_worse_claim_does():
    preds, runs = grid(seeds=(0,))
    same = Claim("self", "id", ("map", "accuracy"), (("map", "accuracy"),), 100, "higher")
    assert claim_interval(same, runs, preds, resamples=200)["per_seed"][0]["verdict"] == "no"
    par = Claim("par", "id", (IB0, "accuracy"), (("map", "accuracy"),), 100, "no_worse", 1.0)
    assert claim_interval(par, runs, preds, resamples=200)["pooled"]["verdict"] == "holds"  # same argmax


def test_an_ood_claim_resamples_both_sides():
    preds, runs = grid(shift=True)
    claim = Claim("ood", "ood", (IB0, "um"), (("map", "mp"),), 100, "higher")
    got = claim_interval(claim, runs, preds, resamples=300)
    assert got["seeds"] == 3 and got["held_on"] == 3 and got["pooled"]["ci95"][0] > 0


def test_seeds_that_answered_other_questions_cannot_be_pooled():
    preds, runs = grid(seeds=(0, 1))
    key = SEP.join(("sciq-ib_edl-s1", "ib_edl", "sciq", "labels"))
    preds.arrays[key] = (preds.arrays[key] + 1) % 4
    claim = Claim("ECE", "id", (IB0, "ece"), (("map", "ece"),), 100, "lower")
    with pytest.raises(ValueError, match="different sciq questions"):
        claim_interval(claim, runs, preds, resamples=200)


def test_a_claim_whose_rows_were_not_run_has_no_seeds():
    preds, runs = grid(seeds=(0,))
    claim = Claim("EDL", "id", (IB0, "ece"), (("edl", "ece"),), 100, "lower")
    assert claim_interval(claim, runs, preds, resamples=200) == {"seeds": 0}


def test_the_interval_covers_a_known_difference_about_95_percent_of_the_time():
    """Coverage, as the interval is stated: a known accuracy gap of 5 points, 200 test sets of 300 questions each."""
    claim = Claim("acc", "id", (IB0, "accuracy"), (("map", "accuracy"),), 100, "higher")
    covered = 0
    for rep in range(200):
        rng = np.random.default_rng(rep)
        labels = np.zeros(300, dtype=int)
        hit_a, hit_b = rng.random(300) < 0.80, rng.random(300) < 0.75
        probs_a = np.where(hit_a[:, None], [0.7, 0.3], [0.3, 0.7])
        probs_b = np.where(hit_b[:, None], [0.6, 0.4], [0.4, 0.6])
        arrays = {}
        put(arrays, "sciq-ib_edl-s0", "ib_edl", "sciq", probs_a, labels, np.full(300, 0.1), probs0=probs_a)
        put(arrays, "sciq-map-s0", "map", "sciq", probs_b, labels)
        got = claim_interval(claim, [Run("id", "id", "sciq", "map", 0, ("sciq",))], GridPredictions(arrays),
                             resamples=300, seed=rep)
        low, high = got["pooled"]["ci95"]
        covered += low <= 5.0 <= high
    assert 181 <= covered <= 197  # Binomial(200, 0.95): 99.9% of coverage counts fall here


def test_over_confidence_is_confidence_minus_accuracy_with_its_interval():
    preds, runs = grid(seeds=(0,))
    runs.append(Run("id", "id", "sciq", "map", 1, ("sciq",)))  # a seed not run yet: left out, not an error
    found = over_confidence(preds, runs, "map", resamples=300)
    assert list(found) == [0]
    got = found[0]
    assert got["over_confidence"]["value"] == pytest.approx(got["mean_confidence"] - got["accuracy"])
    low, high = got["over_confidence"]["ci95"]
    assert 0 < low < got["over_confidence"]["value"] < high  # sharpened: over-confident


def test_an_arm_beside_a_grid_replaces_its_method_and_pairs_with_the_rest():
    preds, runs = grid(seeds=(0, 1))
    arm, _ = grid(seeds=(0, 1))
    arm = GridPredictions({k: v for k, v in arm.arrays.items() if k.split(SEP)[1] == "ib_edl"})
    # the arm's IB-EDL is MAP itself: the claim it makes against MAP is exactly 0 on every resample
    for seed in (0, 1):
        ours = SEP.join((f"sciq-ib_edl-s{seed}", "ib_edl", "sciq", "probs0"))
        arm.arrays[ours] = preds.arrays[SEP.join((f"sciq-map-s{seed}", "map", "sciq", "probs"))]
    merged = beside(preds, arm)
    assert set(merged.arrays) == set(preds.arrays)
    claim = Claim("ECE", "id", (IB0, "ece"), (("map", "ece"),), 100, "lower")
    got = claim_interval(claim, runs, merged, resamples=200)
    assert got["pooled"]["difference"] == 0 and got["pooled"]["ci95"] == [0, 0]
    assert claim_interval(claim, runs, preds, resamples=200)["pooled"]["ci95"][1] < 0  # the grid's own still holds


def test_an_arm_on_other_questions_or_without_a_counterpart_is_refused():
    preds, _ = grid(seeds=(0,))
    arm = GridPredictions({k: v.copy() for k, v in preds.arrays.items() if k.split(SEP)[1] == "ib_edl"})
    key = SEP.join(("sciq-ib_edl-s0", "ib_edl", "sciq", "labels"))
    arm.arrays[key] = (arm.arrays[key] + 1) % 4
    with pytest.raises(ValueError, match="other sciq questions"):
        beside(preds, arm)
    lone = GridPredictions({k.replace("-s0", "-s7"): v for k, v in preds.arrays.items() if "ib_edl" in k})
    with pytest.raises(ValueError, match="sciq-ib_edl-s7 ib_edl on sciq has no counterpart"):
        beside(preds, lone)


def test_grid_rows_an_arm_has_not_run_are_left_out_and_named(caplog):
    preds, runs = grid(seeds=(0, 1))
    arm = GridPredictions({k: v for k, v in preds.arrays.items() if k.startswith("sciq-ib_edl-s0" + SEP)})
    merged = beside(preds, arm)
    assert not merged.has("sciq-ib_edl-s1", "ib_edl", "sciq") and merged.has("sciq-map-s1", "map", "sciq")
    assert "sciq-ib_edl-s1 ib_edl sciq" in caplog.text
    claim = Claim("ECE", "id", (IB0, "ece"), (("map", "ece"),), 100, "lower")
    assert claim_interval(claim, runs, merged, resamples=200)["seeds"] == 1


def test_a_head_to_head_pairs_an_arms_ib_edl_with_the_grids_own_and_says_which_is_better():
    preds, runs = grid(seeds=(0, 1), shift=True)
    arm, _ = grid(seeds=(0, 1), shift=True)
    arm = GridPredictions({k: v for k, v in arm.arrays.items() if k.split(SEP)[1] == "ib_edl"})
    for key in [k for k in arm.arrays if k.endswith(SEP + "probs0") and SEP + "sciq" + SEP in k]:
        arm.arrays[key] = padded(list(sharpen(preds.get(key.split(SEP)[0], "ib_edl", "sciq", bare=True)["probs"],
                                              0.5)))  # the arm over-confident where the grid's is calibrated
    both = GridPredictions({**preds.arrays, **tagged(arm, "arm").arrays})
    assert both.has("sciq-ib_edl-s0", "ib_edl@arm", "sciq") and both.has("sciq-ib_edl-s0", "ib_edl", "sciq")
    claims = {c.text.split(",")[0]: c for c in head_to_head("arm")}
    ece = claim_interval(claims["ECE"], runs, both, resamples=300)
    assert ece["seeds"] == 2 and ece["against_on"] == 2 and ece["pooled"]["against"]  # the arm worse, clearly
    auroc = claim_interval(claims["1/u's mean AUROC over the streams"], runs, both, resamples=300)
    assert auroc["pooled"]["difference"] == 0  # the same u on both sides
    with pytest.raises(ValueError, match="tag"):
        tagged(arm, "a@b")


def test_a_seed_run_beyond_the_config_s_enters_the_claims_it_has_rows_for():
    """The runner's 'seeds=[3]' override runs a seed the config does not list: its kept predictions widen the
    config's seeds, and a claim pools it."""
    from benchmarks.grid_intervals import kept_seeds
    from ibedl.training.experiments.benchmark import expand

    preds, _ = grid(seeds=(0, 1, 2, 3))
    assert preds.seeds() == {0, 1, 2, 3}
    noisy = {**preds.arrays, SEP.join(("sciq-noise0.3-map-s7", "map", "sciq", "probs")): np.zeros((1, 4))}
    assert GridPredictions(noisy).seeds() == {0, 1, 2, 3, 7}  # a noise cell's train key
    assert tagged(preds, "arm").seeds() == {0, 1, 2, 3}  # an arm's rows: the tag is in the method, not the key
    with pytest.raises(ValueError, match=re.escape("'sciq-map|map|sciq|probs'")):
        GridPredictions({"sciq-map|map|sciq|probs": np.zeros((1, 4))}).seeds()
    config = {"methods": ["map", "ib_edl"], "seeds": [0, 1, 2], "experiments": [{"kind": "id", "datasets": ["sciq"]}]}
    widened = kept_seeds(config, preds)
    assert widened["seeds"] == [0, 1, 2, 3] and config["seeds"] == [0, 1, 2]
    claim = Claim("ECE", "id", (IB0, "ece"), (("map", "ece"),), 100, "lower")
    assert claim_interval(claim, expand(widened), preds, resamples=200)["seeds"] == 4
    assert claim_interval(claim, expand(config), preds, resamples=200)["seeds"] == 3


def test_a_noise_seed_run_beyond_the_experiment_s_own_list_enters_the_noise_claims():
    """The noise experiment lists its own seeds ([0, 1]); the runner's 'seeds=[2]' runs seed 2 under noise too, so
    its kept predictions enter the noise claims, and a seed with no noise rows (3) is skipped, not an error."""
    from benchmarks.grid_intervals import kept_seeds
    from ibedl.training.experiments.benchmark import expand

    rng = np.random.default_rng(1)
    arrays = dict(grid(seeds=(0, 1, 2, 3))[0].arrays)
    _, labels = calibrated(200, rng)  # the same test questions on every seed
    for seed in (0, 1, 2):
        for method in ("map", "ib_edl"):
            put(arrays, f"sciq-noise0.3-{method}-s{seed}", method, "sciq", rng.dirichlet(np.ones(4), 200), labels)
    preds = GridPredictions(arrays)
    config = {"methods": ["map", "ib_edl"], "seeds": [0, 1, 2],
              "experiments": [{"kind": "id", "datasets": ["sciq"]},
                              {"kind": "noise", "name": "noise", "datasets": ["sciq"], "seeds": [0, 1]}]}
    widened = kept_seeds(config, preds)
    assert widened["experiments"][1]["seeds"] == [0, 1, 2, 3] and config["experiments"][1]["seeds"] == [0, 1]
    assert "seeds" not in widened["experiments"][0]
    claim = Claim("noise accuracy", "noise", ("ib_edl", "accuracy"), (("map", "accuracy"),), 100, "higher")
    got = claim_interval(claim, expand(widened), preds, resamples=200)
    assert got["seeds"] == 3 and set(got["per_seed"]) == {0, 1, 2}
    assert claim_interval(claim, expand(config), preds, resamples=200)["seeds"] == 2


def test_an_output_that_cannot_be_written_is_refused_before_the_resampling(tmp_path, capsys):
    from benchmarks.grid_intervals import main

    (tmp_path / "afile").write_text("")
    assert main(["--grid", "sciq_grid_shared_lr", "--output", str(tmp_path / "afile" / "i.json")]) == 2
    assert "--output" in capsys.readouterr().err
