"""Learn-Then-Test risk control: the binomial p-value and Clopper-Pearson bound against closed forms, and
the guarantee on synthetic calibrated data."""

from __future__ import annotations

from math import comb

import numpy as np
import pytest

from ibedl.training.risk_control import (
    PROCEDURE_LABEL_FREE,
    PROCEDURE_PILOT,
    accuracy_lower_bound,
    binomial_p_value,
    control_accuracy,
    pilot_start,
)


def test_p_value_is_the_binomial_lower_tail():
    n, errors, eps = 30, 2, 0.1
    closed = sum(comb(n, k) * eps**k * (1 - eps) ** (n - k) for k in range(errors + 1))
    assert binomial_p_value(errors, n, eps) == pytest.approx(closed, rel=1e-12)


def test_clopper_pearson_all_correct_is_delta_to_the_one_over_n():
    # P(Binomial(n, a) = n) = a^n = delta at the bound
    assert accuracy_lower_bound(50, 50, 0.1) == pytest.approx(0.1 ** (1 / 50))
    assert accuracy_lower_bound(0, 10, 0.1) == 0.0


def test_clopper_pearson_bound_solves_its_tail_equation():
    correct, n, delta = 170, 200, 0.05
    a = accuracy_lower_bound(correct, n, delta)
    tail = sum(comb(n, k) * a**k * (1 - a) ** (n - k) for k in range(correct, n + 1))
    assert tail == pytest.approx(delta, rel=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    ({"target_accuracy": 1.0}, "target_accuracy"), ({"target_accuracy": True}, "target_accuracy"),
    ({"delta": 0.0}, "delta"), ({"start_coverage": 0.0}, "start_coverage")])
def test_bad_arguments_are_refused(kwargs, match):
    args = {"target_accuracy": 0.9, "delta": 0.1, **kwargs}
    with pytest.raises(ValueError, match=match):
        control_accuracy([0.9, 0.8], [1, 0], **args)


def test_a_target_the_data_cannot_support_is_not_certified():
    rng = np.random.default_rng(0)
    conf = rng.uniform(0.3, 0.6, 400)
    hits = rng.random(400) < conf  # calibrated, so accuracy never reaches 0.9
    out = control_accuracy(conf, hits, 0.9, 0.1)
    assert not out.certified and out.min_confidence == 1.0 and out.answered == 0


def test_guarantee_holds_on_calibrated_synthetic_data():
    """Confidence c ~ Beta(5, 1.5), correct with probability c: the true accuracy of {c >= lam} is
    E[c | c >= lam], computed on a large sample. Over 300 calibration draws the chosen threshold's true
    accuracy reaches the target in at least 1 - delta of them (minus simulation noise), and certifies
    something useful (the guarantee is not bought by answering nothing)."""
    rng = np.random.default_rng(1)
    target, delta, n = 0.9, 0.1, 500
    population = np.sort(rng.beta(5, 1.5, 400_000))
    tail_mean = np.cumsum(population[::-1])[::-1] / np.arange(len(population), 0, -1)  # E[c | c >= population[i]]
    held, coverage = [], []
    for _ in range(300):
        conf = rng.beta(5, 1.5, n)
        hits = rng.random(n) < conf
        out = control_accuracy(conf, hits, target, delta)
        if not out.certified:
            held.append(True)
            continue
        i = min(np.searchsorted(population, out.min_confidence), len(population) - 1)
        held.append(tail_mean[i] >= target)
        coverage.append(out.coverage)
    assert np.mean(held) >= 1 - delta - 3 * np.sqrt(delta * (1 - delta) / 300)
    oracle = 1 - np.argmax(tail_mean >= target) / len(population)
    assert np.mean(coverage) > 0.5 * oracle


def test_a_small_sample_at_a_small_delta_starts_where_a_test_can_pass():
    """290 questions, delta 0.01: 10% is 29 answers, and no error among 29 gives P = 0.9^29 = 0.047 > 0.01, so a
    sequence starting there stops at its first test. It starts at 2 x 44 answers instead (0.9^44 <= 0.01) and
    certifies a threshold when the confident questions are right."""
    rng = np.random.default_rng(0)
    conf = rng.uniform(0.3, 1.0, 290)
    hits = (rng.uniform(size=290) < np.where(conf > 0.6, 0.98, 0.5)).astype(float)
    result = control_accuracy(conf, hits, target_accuracy=0.9, delta=0.01)
    assert result.certified and result.answered >= 88 and result.accuracy_lower_bound >= 0.9
    assert 0.9 ** 44 <= 0.01 < 0.9 ** 43


def test_a_pilot_starts_the_sequence_where_a_test_can_pass():
    """60% accurate below confidence 0.65 and 95.5% above (about 28% of questions): the label-free start (the
    strictest 10%, about 47 answers) fails at delta 0.05 whenever it meets 3 errors (P(Binomial(47, 0.1) <= 2) =
    0.15), and the sequence stops there; the pilot (200 other questions) starts it near the whole accurate band
    (about 130 answers), where 95.5% passes. Over 200 draws the pilot's start certifies a threshold at least 1.5
    times as often and answers at least 1.5 times as much, and its threshold's true accuracy (known here: the
    population's) reaches the target in at least 1 - delta of the draws it certifies (binomial margin)."""
    rng = np.random.default_rng(5)

    def draw(n):
        conf = rng.beta(2.0, 2.0, n)
        return conf, (rng.random(n) < np.where(conf > 0.65, 0.955, 0.6)).astype(float)

    population, truth = draw(400_000)
    label_free, pilot, held = [], [], []
    for _ in range(200):
        conf, hits = draw(470)
        a = control_accuracy(conf, hits, 0.9, 0.05)
        b = control_accuracy(conf, hits, 0.9, 0.05, start_from=draw(200))
        assert a.procedure == PROCEDURE_LABEL_FREE and a.start is None
        assert b.procedure == PROCEDURE_PILOT and b.start is not None
        label_free.append(a.coverage), pilot.append(b.coverage)
        if b.certified:
            held.append(truth[population >= b.min_confidence].mean() >= 0.9)
    label_free, pilot = np.asarray(label_free), np.asarray(pilot)
    assert np.mean(pilot > 0) >= 1.5 * np.mean(label_free > 0) and pilot.mean() >= 1.5 * label_free.mean()
    assert np.mean(held) >= 1 - 0.05 - 3 * np.sqrt(0.05 * 0.95 / len(held))


def test_the_pilot_start_is_the_cut_most_likely_to_pass():
    """Pilot: 10 questions at confidence 0.9, all right; 10 at 0.5, half right. A calibration part of 100 would answer
    50 at cut 0.9 (passing with at most 1 error at delta 0.01: P(B(50, 0.1) <= 1) = 0.034 > 0.01, so 0 errors:
    0.9^50 = 0.005) and 100 at cut 0.5 (at most 3 errors). With the smoothed error rates (0 + 1) / 12 and
    (5 + 1) / 22, cut 0.9 passes with P(B(50, 1/12) = 0) = 0.013, cut 0.5 with P(B(100, 6/22) <= 3) ~ 0: 0.9 is the
    start; a cut where the pilot answers nothing, or where no count of errors can pass, is never one."""
    conf = np.r_[np.full(10, 0.9), np.full(10, 0.5)]
    hits = np.r_[np.ones(10), np.r_[np.ones(5), np.zeros(5)]]
    assert binomial_p_value(0, 50, 0.1) <= 0.01 < binomial_p_value(1, 50, 0.1)
    assert pilot_start(np.array([0.95, 0.9, 0.5]), 100, conf, hits, 0.1, 0.01) == 0.9
    assert pilot_start(np.array([0.95]), 100, conf, hits, 0.1, 0.01) is None  # the pilot answers nothing there
    assert pilot_start(np.array([0.9]), 20, conf, hits, 0.1, 0.01) is None  # 10 answers cannot pass at 0.01


@pytest.mark.parametrize("seed", range(5))
def test_the_sequence_its_p_values_and_its_choice_are_mapies(seed):
    """MAPIE's Learn-Then-Test pieces on the same thresholds: its p-value for a binary loss (the Bentkus bound,
    min'd with Hoeffding's) equals ours, the exact binomial tail, and its fixed-sequence testing
    (control_fwer(..., "fixed_sequence")) over our sequence, from the pilot's start towards looser thresholds,
    rejects exactly the thresholds we certify: the loosest is the one served."""
    from mapie.risk_control import control_fwer
    from mapie.risk_control.methods import compute_hoeffding_bentkus_p_value

    rng = np.random.default_rng(seed)

    def draw(n):
        conf = rng.beta(3.0, 1.5, n)
        return conf, (rng.random(n) < conf).astype(float)

    conf, hits = draw(600)
    pilot = draw(250)
    ours = control_accuracy(conf, hits, 0.85, 0.05, start_from=pilot)
    # the candidate thresholds as control_accuracy builds them, strictest first, from the pilot's start on
    cuts = np.unique(np.quantile(conf, np.linspace(0.0, 1.0, 201)))[::-1]
    sequence = [lam for lam in cuts if lam <= ours.start and (conf >= lam).any()]
    n_obs = np.array([(conf >= lam).sum() for lam in sequence], dtype=float)
    errors = np.array([(1.0 - hits[conf >= lam]).sum() for lam in sequence])
    # MAPIE counts errors as ceil(n * r_hat): for r_hat = e / n in floating point that is e + 1 for about 2% of
    # (e, n) pairs (a conservative p-value, still valid); the float just below e / n gives it e itself
    r_hat = np.where(np.ceil(n_obs * (errors / n_obs)) == errors, errors / n_obs,
                     np.nextafter(errors / n_obs, 0.0))
    theirs = compute_hoeffding_bentkus_p_value(r_hat, n_obs, 0.15, binary=True)[:, 0]
    mine = [binomial_p_value(int(e), int(m), 0.15) for m, e in zip(n_obs, errors, strict=True)]
    assert theirs == pytest.approx(mine, rel=1e-9, abs=1e-300)
    rejected = control_fwer(theirs, 0.05, fwer_method="fixed_sequence")
    if ours.certified:
        assert list(rejected) == list(range(len(rejected))) and sequence[rejected[-1]] == ours.min_confidence
        assert ours.candidates_tested == len(rejected) + (len(rejected) < len(sequence))
    else:
        assert len(rejected) == 0
