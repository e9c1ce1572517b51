import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score
from torchmetrics.classification import MulticlassCalibrationError

from ibedl.training import metrics


@pytest.fixture
def preds():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(500, 4)) * 2
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    labels = np.where(rng.random(500) < 0.6, probs.argmax(1), rng.integers(0, 4, 500))
    return probs, labels


@pytest.mark.parametrize("bins", [10, 15, 25, 35])
def test_ece_matches_torchmetrics(preds, bins):
    probs, labels = preds
    ref = MulticlassCalibrationError(num_classes=4, n_bins=bins, norm="l1")(torch.tensor(probs), torch.tensor(labels))
    assert metrics.ece(probs, labels, bins) == pytest.approx(ref.item(), abs=1e-6)


def test_ece_of_perfectly_calibrated_bins_is_zero():
    # 10 questions at confidence 0.7 with 7 right
    probs = np.tile([0.7, 0.1, 0.1, 0.1], (10, 1))
    labels = np.array([0] * 7 + [1] * 3)
    assert metrics.ece(probs, labels) == pytest.approx(0.0, abs=1e-12)


def test_ragged_option_counts(preds):
    probs = [np.array([0.5, 0.5]), np.array([0.1, 0.2, 0.7]), np.array([0.25] * 4)]
    labels = [1, 2, 3]
    assert metrics.accuracy(probs, labels) == pytest.approx(1 / 3)  # ties go to the first option
    assert metrics.nll(probs, labels) == pytest.approx(np.mean([-np.log(0.5), -np.log(0.7), -np.log(0.25)]))
    assert metrics.brier(probs, labels) == pytest.approx(np.mean([0.5, 0.01 + 0.04 + 0.09, 0.1875 + 0.5625]))


def test_nll_guards_zero_probability():
    assert np.isfinite(metrics.nll([np.array([1.0, 0.0])], [1]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auroc_matches_sklearn(seed):
    rng = np.random.default_rng(seed)
    pos = np.round(rng.normal(1, 1, 300), 1)  # rounding creates ties
    neg = np.round(rng.normal(0, 1, 200), 1)
    ref = roc_auc_score(np.r_[np.ones(300), np.zeros(200)], np.r_[pos, neg])
    assert metrics.auroc(pos, neg) == pytest.approx(ref, abs=1e-12)


def test_risk_coverage_and_aurc():
    scores = [0.9, 0.8, 0.7, 0.6]
    hits = [1, 0, 1, 0]
    cov, risk = metrics.risk_coverage(scores, hits)
    np.testing.assert_allclose(cov, [0.25, 0.5, 0.75, 1.0])
    np.testing.assert_allclose(risk, [0.0, 0.5, 1 / 3, 0.5])
    assert metrics.aurc(scores, hits) == pytest.approx(np.mean([0, 0.5, 1 / 3, 0.5]))
    assert metrics.accuracy_at_coverage(scores, hits, 0.5) == pytest.approx(0.5)
    assert metrics.accuracy_at_coverage(scores, hits, 0.75) == pytest.approx(2 / 3)


def test_summarise_keys(preds):
    probs, labels = preds
    out = metrics.summarise(probs, labels, uncertainty=np.linspace(0, 1, 500))
    for key in ("accuracy", "ece", "nll", "brier", "aurc", "acc@80", "acc@90", "ece_10", "ece_35", "aurc_um"):
        assert np.isfinite(out[key]), key
    assert out["ece"] == out["ece_15"]


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_bins must be >= 1, got 0"):
        metrics.ece([[0.5, 0.5]], [0], 0)
    with pytest.raises(ValueError, match="2 predictions for 1 labels"):
        metrics.accuracy([[0.5, 0.5], [0.5, 0.5]], [0])
    with pytest.raises(ValueError, match="coverage"):
        metrics.accuracy_at_coverage([1.0], [1], 0)


@pytest.mark.parametrize("fn", [metrics.nll, metrics.brier, metrics.accuracy, metrics.ece])
def test_a_label_outside_its_options_is_refused_not_wrapped(fn):
    # -1 would index the last option of [0.2, 0.8] and give NLL -log 0.8 for a question that has no such answer.
    with pytest.raises(ValueError, match="label -1 of question 1 is outside its 2 options"):
        fn([[0.5, 0.5], [0.2, 0.8]], [0, -1])
    with pytest.raises(ValueError, match="label 3 of question 0 is outside its 3 options"):
        fn([[0.2, 0.3, 0.5]], [3])
