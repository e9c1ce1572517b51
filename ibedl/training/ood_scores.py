"""Out-of-distribution scores beside max probability and 1/u, read from the forward pass the head already runs.

- ``energy``: logsumexp of the option logits (pre-evidence for evidential heads, mu for IB-EDL) over the real options,
  the negative free energy of Liu et al. (2020); higher means more in-distribution.
- ``mahalanobis``: minus the smallest squared Mahalanobis distance of the hidden state the head reads to
  class-conditional Gaussians with a tied covariance (Lee et al., 2018), fitted on a calibration sample (classes:
  the answer's option index); the covariance is shrunk (Ledoit-Wolf), as a few hundred questions cannot estimate
  a d x d covariance alone. Higher means more in-distribution.

Both come from the first adapter's deterministic pass (dropout off): MC-Dropout, Laplace and MAP+TS share MAP's
scores, an ensemble's are its first member's.

References:
    Liu, Wang, Owens, Li. Energy-based Out-of-distribution Detection. NeurIPS 2020.
    Lee, Lee, Lee, Shin. A Simple Unified Framework for Detecting Out-of-Distribution Samples and Adversarial
    Attacks. NeurIPS 2018.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ibedl.training.evaluate import chunks

SCORES = ("energy", "mahalanobis")


def energy(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """logits, mask: (B, C) -> (B,) logsumexp over each row's real options (float32)."""
    if logits.shape != mask.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and mask {tuple(mask.shape)} must have one shape")
    return torch.logsumexp(logits.float().masked_fill(~mask, float("-inf")), dim=-1)


@torch.no_grad()
def features(predictor, questions: list, batch_size: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Energy (N,) and last-token hidden states (N, d) of ``questions`` from the first adapter's pass, dropout off.
    The batches are :func:`ibedl.training.evaluate.predict_all`'s: under ``Predictor.reusing_hidden`` after it, no
    trunk pass is repeated."""
    model = predictor.model
    was_training = model.training
    model.eval()
    if predictor.members is not None and hasattr(model, "set_adapter"):
        predictor.activate(predictor.members[0])
    energies = torch.zeros(len(questions), dtype=torch.float32)
    hidden: torch.Tensor | None = None
    try:
        for idx in chunks(questions, batch_size):
            for group, batch in predictor.batches([questions[k] for k in idx]):
                rows = torch.tensor([idx[g] for g in group])
                h = predictor.hidden(batch)
                mask = batch.option_mask.to(h.device)
                energies[rows] = energy(predictor.heads[0](h, mask).logits, mask).cpu()
                if hidden is None:
                    hidden = torch.zeros(len(questions), h.shape[-1], dtype=torch.float32)
                hidden[rows] = h.float().cpu()
    finally:
        if was_training:
            model.train()
    if hidden is None:
        raise ValueError("features needs at least one question")
    return energies.numpy().astype(np.float64), hidden.numpy().astype(np.float64)


@dataclass
class Mahalanobis:
    """Class means (K, d) and the shrunk tied precision matrix (d, d) of a calibration sample."""

    means: np.ndarray
    precision: np.ndarray
    shrinkage: float

    @classmethod
    def fit(cls, hidden: np.ndarray, labels) -> Mahalanobis:
        """hidden: (N, d) states of the calibration sample; labels: (N,) their answers' option indices."""
        from sklearn.covariance import LedoitWolf

        hidden = np.asarray(hidden, dtype=np.float64)
        labels = np.asarray(labels, dtype=np.int64)
        if hidden.ndim != 2 or len(hidden) != len(labels) or len(hidden) < 2:
            raise ValueError(
                f"hidden must be (N, d) with N = len(labels) >= 2, got {hidden.shape} and {len(labels)} labels"
            )
        classes = np.unique(labels)
        means = np.zeros((int(classes.max()) + 1, hidden.shape[1]))
        present = np.zeros(len(means), dtype=bool)
        centred = np.empty_like(hidden)
        for c in classes:
            rows = labels == c
            means[c], present[c] = hidden[rows].mean(0), True
            centred[rows] = hidden[rows] - means[c]
        lw = LedoitWolf(assume_centered=True).fit(centred)
        return cls(means=means[present], precision=lw.precision_, shrinkage=float(lw.shrinkage_))

    def score(self, hidden: np.ndarray) -> np.ndarray:
        """(N, d) -> (N,) minus the smallest squared distance to a class mean (higher: more in-distribution)."""
        diff = np.asarray(hidden, dtype=np.float64)[:, None, :] - self.means[None]  # (N, K, d)
        dist = np.einsum("nkd,de,nke->nk", diff, self.precision, diff)
        return -dist.min(axis=1)
