import numpy as np
import pytest
from scipy.stats import ks_2samp

from ibedl.engine.drift import DriftMonitor, ks_statistic, psi


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ks_matches_scipy(seed):
    rng = np.random.default_rng(seed)
    a, b = rng.beta(2, 5, 300), np.round(rng.beta(2, 4, 200), 2)  # ties in b
    assert ks_statistic(a, b) == pytest.approx(ks_2samp(a, b).statistic, abs=1e-12)


def test_psi_zero_for_same_distribution_and_large_for_shift():
    rng = np.random.default_rng(0)
    ref = rng.beta(2, 5, 2000)
    assert psi(ref, ref) == pytest.approx(0.0, abs=1e-9)
    assert psi(ref, rng.beta(5, 2, 500)) > 1.0


def test_healthy_stream_rarely_alarms_and_shift_alarms():
    rng = np.random.default_rng(1)
    reference = rng.beta(2, 5, 400)  # a validation sample of u
    alarms = 0
    trials = 200
    monitor = DriftMonitor(reference, "uncertainty_mass", window_size=100, alarm_rate=0.01, draws=1000)
    for _ in range(trials):
        monitor.window.clear()
        monitor.add(rng.beta(2, 5, 100))  # a fresh in-distribution window
        alarms += monitor.status()["alarm"]
    assert alarms / trials <= 0.04  # calibrated for 1%; the bootstrap includes the reference's own noise
    monitor.window.clear()
    monitor.add(rng.beta(4, 3, 100))  # answers get much less certain
    status = monitor.status()
    assert status["alarm"] and status["ks"] > status["ks_threshold"]


def test_no_alarm_before_the_window_is_full():
    rng = np.random.default_rng(2)
    monitor = DriftMonitor(rng.beta(2, 5, 300), "uncertainty_mass", window_size=50, draws=200)
    monitor.add(np.ones(49))
    assert monitor.status()["alarm"] is False
    monitor.add([1.0])
    assert monitor.status()["alarm"] is True


def test_collapsed_reference_disables_the_alarm():
    monitor = DriftMonitor([1.0] * 200, "uncertainty_mass", window_size=20, draws=100)
    monitor.add([0.5] * 20)
    status = monitor.status()
    assert not monitor.enabled and status["alarm"] is False and status["ks_threshold"] is None
