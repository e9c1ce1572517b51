import numpy as np
import pytest

from training.abstention import choose_thresholds
from training.posthoc import adjust_alpha, fit_zeta, nll_with_zeta


def test_thresholds_reach_target_on_validation():
    rng = np.random.default_rng(0)
    u = rng.random(400)
    hits = (rng.random(400) > u).astype(float)  # low u -> likely right
    conf = 1 - u / 2
    out = choose_thresholds(conf, hits, u, target_accuracy=0.8)
    answered = (u <= out["max_uncertainty"]) & (conf >= out["min_confidence"])
    assert out["how"]["target_reached"]
    assert hits[answered].mean() >= 0.8
    assert out["how"]["coverage"] == pytest.approx(answered.mean())
    assert 0.2 < out["how"]["coverage"] < 0.9


def test_unreachable_target_keeps_best_accuracy_and_says_so():
    hits = np.array([1, 0] * 50, dtype=float)
    conf = np.full(100, 0.5)
    out = choose_thresholds(conf, hits, None, target_accuracy=0.99)
    assert not out["how"]["target_reached"]
    assert out["max_uncertainty"] == 1.0
    assert out["how"]["answered_accuracy"] == pytest.approx(0.5)


def test_bad_target():
    with pytest.raises(ValueError, match="target_accuracy must be in \\(0, 1\\], got 1.5"):
        choose_thresholds([0.5], [1.0], None, 1.5)


def test_zeta_adjustment_and_fit():
    alpha = [np.array([5.0, 2.0, 1.5])] * 30 + [np.array([5.0, 2.0, 1.5])] * 20
    sigma = [np.array([2.0, 0.5, 0.5])] * 50
    labels = [0] * 30 + [1] * 20  # 60% right at confidence 0.59: roughly calibrated already
    np.testing.assert_allclose(adjust_alpha(alpha[0], sigma[0], 1.0), [3.0, 1.5, 1.0])
    np.testing.assert_allclose(adjust_alpha(alpha[0], sigma[0], 10.0), [1.0, 1.0, 1.0])  # floored at 1
    zeta, info = fit_zeta(alpha, sigma, labels)
    assert info["nll_at_zeta"] <= info["nll_at_0"]
    assert nll_with_zeta(alpha, sigma, labels, zeta) == pytest.approx(info["nll_at_zeta"])
    # an over-confident predictor (alpha large on a coin flip) gets a positive zeta
    over = [np.array([20.0, 1.0])] * 40
    sig = [np.array([3.0, 0.1])] * 40
    zeta_over, _ = fit_zeta(over, sig, [0, 1] * 20)
    assert zeta_over > 0
