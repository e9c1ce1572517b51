"""Learn-Then-Test risk control: the binomial p-value and Clopper-Pearson bound against closed forms, and
the guarantee on synthetic calibrated data."""

from __future__ import annotations

from math import comb

import numpy as np
import pytest

from ibedl.training.risk_control import accuracy_lower_bound, binomial_p_value, control_accuracy


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
