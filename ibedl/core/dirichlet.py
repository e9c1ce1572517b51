"""Dirichlet quantities of evidential classification: alpha, expected probabilities, belief and
uncertainty masses, and the Dirichlet KL divergence, all with an option mask for ragged C.

Every function takes an optional ``mask: (B, C) bool`` marking the real options of each question
(questions in a batch may have different numbers of options). Padded entries contribute nothing to
sums and come back as 0. All math runs in float32 whatever the input dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def full_mask(x: torch.Tensor) -> torch.Tensor:
    """All-true mask shaped like ``x: (B, C)``."""
    return torch.ones(x.shape, dtype=torch.bool, device=x.device)


def _mask(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return full_mask(x)
    if mask.shape != x.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match {tuple(x.shape)}")
    return mask.bool()


def evidence_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Evidence e = softplus(logits) >= 0, in float32. ``logits: (B, C)`` pre-evidence."""
    return F.softplus(logits.float())


def alpha_from_logits(logits: torch.Tensor, offset: float = 1.0) -> torch.Tensor:
    """Dirichlet concentration alpha = softplus(logits) + offset (offset 1 for EDL, eta for R-EDL)."""
    if offset <= 0:
        raise ValueError(f"offset must be > 0, got {offset}")
    return evidence_from_logits(logits) + offset


def strength(alpha: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Dirichlet strength alpha0 = sum_j alpha_j over real options. Returns (B,)."""
    m = _mask(alpha, mask)
    return (alpha.float() * m).sum(-1)


@dataclass
class DirichletOutputs:
    """Subjective-logic view of a Dirichlet, all (B, C) except ``uncertainty`` and ``strength`` (B,).

    ``probs`` = alpha / alpha0, ``belief`` = (alpha - offset) / alpha0, ``uncertainty`` =
    C * offset / alpha0, so that sum_j belief_j + uncertainty = 1 and probs_j = belief_j +
    uncertainty / C for every question.
    """

    alpha: torch.Tensor
    probs: torch.Tensor
    belief: torch.Tensor
    uncertainty: torch.Tensor
    strength: torch.Tensor


def dirichlet_outputs(
    alpha: torch.Tensor, mask: torch.Tensor | None = None, offset: float = 1.0
) -> DirichletOutputs:
    """Expected probabilities, belief masses and uncertainty mass of ``alpha: (B, C)``.

    Args:
        alpha: (B, C) concentration, every real entry >= offset.
        mask: (B, C) real options; padded entries return 0.
        offset: the prior count per option (1 for EDL; eta for R-EDL).
    """
    m = _mask(alpha, mask)
    a = alpha.float() * m
    a0 = a.sum(-1, keepdim=True)  # (B, 1)
    num_options = m.sum(-1, keepdim=True).float()  # (B, 1)
    probs = a / a0
    belief = ((a - offset) * m) / a0
    uncertainty = (num_options * offset / a0).squeeze(-1)
    return DirichletOutputs(alpha=a, probs=probs, belief=belief, uncertainty=uncertainty, strength=a0.squeeze(-1))


def masked_softmax(logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over real options of ``logits: (B, C)``, in float32; padded entries are 0."""
    m = _mask(logits, mask)
    z = logits.float().masked_fill(~m, float("-inf"))
    return torch.softmax(z, dim=-1).masked_fill(~m, 0.0)


def dirichlet_kl(
    alpha: torch.Tensor, beta: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """KL(Dir(alpha) || Dir(beta)) per row, over real options. Returns (B,).

    KL = lgamma(a0) - sum lgamma(a_j) - lgamma(b0) + sum lgamma(b_j)
         + sum (a_j - b_j) (psi(a_j) - psi(a0)).
    Padded entries are set to 1 in both, where every term vanishes.
    """
    m = _mask(alpha, mask)
    one = torch.ones((), dtype=torch.float32, device=alpha.device)
    a = torch.where(m, alpha.float(), one)
    b = torch.where(m, beta.float(), one)
    a0 = (a * m).sum(-1)
    b0 = (b * m).sum(-1)
    return (
        torch.lgamma(a0)
        - (torch.lgamma(a) * m).sum(-1)
        - torch.lgamma(b0)
        + (torch.lgamma(b) * m).sum(-1)
        + ((a - b) * (torch.digamma(a) - torch.digamma(a0).unsqueeze(-1)) * m).sum(-1)
    )
