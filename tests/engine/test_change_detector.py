"""The change detector of a stated guarantee (ibedl.engine.change_detector): its e-values' mean is at most 1 while the
promise holds (closed form), its false alarms stay under horizon / threshold at the null's boundary (simulation
with a binomial margin), its delay after a drop does not grow with the history, its change point is where the drop
began, and its state continues bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from ibedl.engine.change_detector import DROPS, ChangeDetector, alarm_threshold


def test_each_alternative_s_e_value_is_the_bernoulli_likelihood_ratio_and_a_supermartingale_factor():
    d = ChangeDetector(0.9, 10.0)
    for rho, a, b in zip(d.alternatives, d._a, d._b, strict=True):
        assert a == pytest.approx((1 - rho) / (1 - 0.9)) and a + b == pytest.approx(rho / 0.9)  # LR at x = 0, 1
        for mean in (0.9, 0.95, 1.0):  # E[e] = a + b E[x] <= 1 whenever E[x] >= t
            assert a + b * mean <= 1 + 1e-12
        assert a + b * 1.0 > 0  # non-negative on [0, 1]
    assert list(d.alternatives) == pytest.approx([0.9 - x for x in DROPS])


def test_false_alarms_at_the_boundary_stay_under_horizon_over_threshold():
    """Every outcome Bernoulli(t): the worst case the promise allows. 2,000 streams of 2,000 outcomes at threshold
    20,000: at most 2,000 / 20,000 = 10% may alarm."""
    rng = np.random.default_rng(0)
    streams, horizon = 2000, 2000
    d = ChangeDetector(0.9, 20_000.0, (streams,))
    for _ in range(horizon):
        d.update(rng.random(streams) < 0.9)
    rate = d.alarmed().mean()
    assert rate <= horizon / 20_000 + 3 * np.sqrt(0.1 * 0.9 / streams)
    assert alarm_threshold(horizon, 0.1) == 20_000.0 and alarm_threshold(100_000, 0.01, series=2) == 2e7


def test_the_delay_after_a_drop_does_not_grow_with_the_history():
    """95% right, then 60%: the median delay is about the same after 500 and after 20,000 healthy outcomes, near
    log(A) / KL(0.6 || 0.9) ~ 16.8 / 0.31 ~ 54, and the change point is where the drop began."""
    rng = np.random.default_rng(1)
    threshold = alarm_threshold(100_000, 0.01, series=2)
    delays, changes = {}, {}
    for history in (500, 20_000):
        d = ChangeDetector(0.9, threshold, (200,))
        for _ in range(history):
            d.update(rng.random(200) < 0.95)
        assert not d.alarmed().any()
        for _ in range(400):
            d.update(rng.random(200) < 0.6)
        assert d.alarmed().all()
        delays[history] = np.median(d.alarm_at - history)
        changes[history] = np.median(d.change_at - history)
    assert 30 <= delays[500] <= 90 and abs(delays[20_000] - delays[500]) <= 10
    assert all(0 <= c <= 10 for c in changes.values())


def test_marks_report_the_change_point_in_the_caller_s_numbering():
    d = ChangeDetector(0.9, 1e4)
    for seq in range(1, 301):  # store sequence numbers 1001..1300: right until 1150, wrong after
        d.update(1.0 if seq <= 150 else 0.0, mark=1000 + seq)
    assert d.alarmed() and 1150 <= int(d.change_at) <= 1153 and int(d.alarm_at) <= 170


def test_an_alarmed_stream_keeps_counting_and_its_statistic_stays_finite():
    """After the alarm every outcome is still counted, but the statistic stops where it alarmed: 5,000 misses at
    target 0.9 would multiply it by up to 10 each (past float64's range after about 310)."""
    d = ChangeDetector(0.9, 2e7, (2,))
    for _ in range(100):
        d.update(np.array([0.0, 1.0]))
    assert d.alarmed().tolist() == [True, False]
    at, frozen = int(d.alarm_at[0]), d.statistic()[0]
    with np.errstate(over="raise"):
        for _ in range(5000):
            d.update(np.array([0.0, 1.0]))
    assert d.n.tolist() == [5100, 5100] and int(d.alarm_at[0]) == at
    assert np.isfinite(d.statistic()).all() and d.statistic()[0] == frozen and frozen >= 2e7


def test_a_state_an_earlier_release_let_overflow_restores_finite_and_alarmed():
    """An earlier release went on multiplying an alarmed stream's statistics until they were inf, and checkpointed
    them so: restored, the statistic is finite (a number GET /v1/guarantees and the gauge can show) and stays."""
    old = ChangeDetector(0.9, 2e7)
    for _ in range(100):
        old.update(0.0)
    old.sr[...], old.cusum[...] = np.inf, np.inf
    new = ChangeDetector(0.9, 2e7)
    new.restore(old.state())
    for _ in range(10):
        new.update(0.0)
    assert new.alarmed() and int(new.n) == 110 and np.isfinite(new.statistic()) and new.statistic() >= 2e7


def test_inactive_streams_are_left_as_they_are_and_the_state_continues_bit_for_bit():
    rng = np.random.default_rng(2)
    d = ChangeDetector(0.85, 1e5, (3,))
    for _ in range(50):
        d.update(rng.random(3) < 0.7, active=np.array([True, False, True]))
    assert d.n.tolist() == [50, 0, 50] and d.statistic()[1] == 0.0
    copy = ChangeDetector(0.85, 1e5, (3,))
    copy.restore(d.state())
    for _ in range(30):
        x = rng.random(3) < 0.5
        d.update(x)
        copy.update(x)
    assert d.state() == copy.state() and (d.alarm_at == copy.alarm_at).all()
    with pytest.raises(ValueError, match="is not one of this detector"):
        ChangeDetector(0.85, 1e5, (2,)).restore(d.state())


@pytest.mark.parametrize("kwargs, match", [
    ({"target": 1.0, "threshold": 10.0}, "target must be in"), ({"target": 0.9, "threshold": 1.0}, "threshold"),
    ({"target": 0.01, "threshold": 10.0, "drops": (0.05,)}, "no alternative below target")])
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ChangeDetector(**kwargs)


def test_outcomes_outside_zero_one_are_refused():
    with pytest.raises(ValueError, match=r"outcomes must lie in \[0, 1\]"):
        ChangeDetector(0.9, 10.0).update(1.5)
