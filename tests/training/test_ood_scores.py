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


def test_features_reuse_the_trunk_passes_of_predict_all(tiny_model_dir, monkeypatch):
    from ibedl.core.base_model import load_base_model, resolve_model
    from ibedl.core.head import HeadConfig, build_head
    from ibedl.core.predictor import Predictor, lm_head_rows
    from ibedl.core.prompt import MCQuestion, option_token_ids
    from ibedl.training.evaluate import predict_all
    from ibedl.training.ood_scores import features

    model, tok = load_base_model(resolve_model(tiny_model_dir), device="cpu")
    rows = lm_head_rows(model, option_token_ids(tok, 26))
    head = build_head(HeadConfig("softmax", 26, model.config.hidden_size), rows)
    predictor = Predictor(model, tok, head, template="plain-v1", max_tokens=256)
    questions = [MCQuestion(f"Question {i}: " + "why " * (7 * i % 11), ("a", "b", "c", "d")[: 2 + i % 3])
                 for i in range(11)]
    energies, hidden = features(predictor, questions, batch_size=4)  # without the memo
    calls, real = [], predictor._hidden
    monkeypatch.setattr(predictor, "_hidden", lambda batch: calls.append(batch.input_ids.shape[0]) or real(batch))
    with predictor.reusing_hidden():
        preds, _ = predict_all(predictor, questions, batch_size=4, progress=False)
        assert sum(calls) == len(questions)
        again = features(predictor, questions, batch_size=4)
    assert sum(calls) == len(questions)  # no trunk pass repeated
    np.testing.assert_array_equal(again[0], energies)  # same batches, same numbers as without the memo
    np.testing.assert_array_equal(again[1], hidden)
    # each question's energy is logsumexp of its own option logits: read back in input order
    for i, q in enumerate(questions):
        one = predictor.forward(predictor.encode([q]))
        np.testing.assert_allclose(energies[i], torch.logsumexp(one.logits[0, : q.num_options], 0).item(), rtol=1e-4)
