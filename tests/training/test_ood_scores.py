import numpy as np
import pytest
import torch
from sklearn.covariance import LedoitWolf

from ibedl.training.ood_scores import Mahalanobis, energy


def test_energy_is_logsumexp_over_real_options():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0], [0.5, -1.0, 9.0, 9.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    expected = [np.log(np.exp(1) + np.exp(2) + np.exp(3)), np.log(np.exp(0.5) + np.exp(-1))]
    np.testing.assert_allclose(energy(logits, mask).numpy(), expected, rtol=1e-6)
    with pytest.raises(ValueError, match=r"logits \(2, 4\) and mask \(2, 3\)"):
        energy(logits, mask[:, :3])


def test_mahalanobis_matches_the_closed_form_with_ledoit_wolf_covariance():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, 60)
    centres = rng.normal(size=(3, 5)) * 3
    hidden = centres[labels] + rng.normal(size=(60, 5))
    maha = Mahalanobis.fit(hidden, labels)
    centred = hidden - np.stack([hidden[labels == c].mean(0) for c in range(3)])[labels]
    cov = LedoitWolf(assume_centered=True).fit(centred).covariance_
    queries = rng.normal(size=(4, 5)) * 3
    expected = [-min((q - hidden[labels == c].mean(0)) @ np.linalg.inv(cov) @ (q - hidden[labels == c].mean(0))
                     for c in range(3)) for q in queries]
    np.testing.assert_allclose(maha.score(queries), expected, rtol=1e-6)
    # A point at a class mean scores 0, the highest possible; far points score lower.
    assert maha.score(maha.means[:1])[0] == pytest.approx(0.0, abs=1e-9)
    assert maha.score(maha.means[:1] + 100).item() < -1


def test_mahalanobis_refuses_mismatched_input():
    with pytest.raises(ValueError, match=r"hidden must be \(N, d\) with N = len\(labels\) >= 2, got \(3, 2\) and 2"):
        Mahalanobis.fit(np.zeros((3, 2)), [0, 1])
