"""Training objectives of the methods, as per-question functions of the head outputs.

Every function takes ``mask: (B, C)`` (real options) and integer targets ``y: (B,)`` and returns a
per-question loss ``(B,)`` in float32 at least (some keep float64 inputs in float64, the digamma-based ones return
float32); callers take the mean. digamma, lgamma and polygamma run in float32 whatever the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ibedl.core.dirichlet import dirichlet_kl
from ibedl.core.head import SIGMA_FLOOR


def wide(x: torch.Tensor) -> torch.Tensor:
    """x in float32, or float64 if it already is: half precision never reaches digamma or a loss."""
    return x if x.dtype == torch.float64 else x.float()


def one_hot(y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) targets -> (B, C) float32 one-hot, checking every target is a real option."""
    if y.dim() != 1 or y.shape[0] != mask.shape[0]:
        raise ValueError(f"targets must be (B,) with B={mask.shape[0]}, got {tuple(y.shape)}")
    if bool((y < 0).any()) or bool((y >= mask.sum(-1)).any()):
        raise ValueError(f"targets {y.tolist()} fall outside the real options {mask.sum(-1).tolist()}")
    return F.one_hot(y.long(), mask.shape[1]).float()


def cross_entropy(logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """-log softmax(z)_y over real options. logits: (B, C)."""
    z = logits.float().masked_fill(~mask, float("-inf"))
    return F.cross_entropy(z, y.long(), reduction="none")


def mse_bayes_risk(alpha: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, variance: bool = True) -> torch.Tensor:
    """E_{pi ~ Dir(alpha)} ||y - pi||^2 = sum_j (y_j - p_j)^2 + p_j (1 - p_j) / (alpha0 + 1).

    The variance term is Var_Dir[pi_j] = alpha_j (alpha0 - alpha_j) / (alpha0^2 (alpha0 + 1)). The paper's
    eq. (3) prints (alpha_j + 1) in that denominator; the Dirichlet variance has (alpha0 + 1), which the
    Monte Carlo test confirms. ``variance=False`` drops the term (R-EDL).

    References:
        Sensoy, Kaplan, Kandemir. Evidential Deep Learning to Quantify Classification Uncertainty. NeurIPS 2018.
    """
    target = one_hot(y, mask)
    a = wide(alpha) * mask
    a0 = a.sum(-1, keepdim=True)
    p = a / a0
    risk = ((target - p) ** 2) * mask
    if variance:
        risk = risk + p * (1 - p) / (a0 + 1) * mask
    return risk.sum(-1)


def digamma_ce_risk(alpha: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """E_{pi ~ Dir(alpha)} [-log pi_y] = psi(alpha0) - psi(alpha_y)."""
    a = torch.where(mask, alpha.float(), torch.ones((), device=alpha.device))
    a0 = (a * mask).sum(-1)
    a_y = a.gather(1, y.long().unsqueeze(1)).squeeze(1)
    return torch.digamma(a0) - torch.digamma(a_y)


def edl_kl_regulariser(alpha: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(Dir(alpha~) || Dir(1)) with alpha~ = y + (1 - y) alpha: evidence for wrong options only."""
    return wrong_evidence_kl(alpha, y, mask, 1.0)


def gaussian_information(mu: torch.Tensor, sigma: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(N(mu, diag sigma^2) || N(0, I)) = 0.5 sum_j (mu_j^2 + sigma_j^2 - 2 log sigma_j - 1).

    References:
        IB-EDL, eq. (info term); the -1 makes it exactly the KL (the paper drops the constant).
    """
    s = sigma.float().clamp_min(SIGMA_FLOOR)
    kl = 0.5 * (mu.float() ** 2 + s**2 - 2 * torch.log(s) - 1)
    return (kl * mask).sum(-1)


def sample_pre_evidence(mu: torch.Tensor, sigma: torch.Tensor, num_samples: int, generator=None) -> torch.Tensor:
    """K reparameterised samples e~ = mu + sigma * eps: (K, B, C)."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    eps = torch.randn((num_samples, *mu.shape), device=mu.device, dtype=torch.float32, generator=generator)
    return mu.float() + sigma.float() * eps


def dirichlet_mean_nll(alpha: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """-log p(y | alpha) = log alpha0 - log alpha_y, with p(y | alpha) = alpha_y / alpha0 (IB-EDL's L_IB-NLL)."""
    a = torch.where(mask, wide(alpha), torch.ones((), device=alpha.device))
    a0 = (a * mask).sum(-1)
    return torch.log(a0) - torch.log(a.gather(1, y.long().unsqueeze(1)).squeeze(1))


RISKS = {"mse": mse_bayes_risk, "nll": dirichlet_mean_nll}


def ib_edl_risk(
    mu: torch.Tensor, sigma: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, num_samples: int, generator=None,
    risk: str = "mse",
) -> torch.Tensor:
    """mean_k risk(softplus(e~_k) + 1, y) over K samples of the pre-evidence. Returns (B,).

    ``risk``: ``mse`` (Bayes risk of the squared error) or ``nll`` (-log alpha_y / alpha0).
    """
    if risk not in RISKS:
        raise ValueError(f"risk must be one of {sorted(RISKS)}, got {risk!r}")
    samples = sample_pre_evidence(mu, sigma, num_samples, generator)  # (K, B, C)
    alpha = F.softplus(samples) + 1.0
    k, b, c = alpha.shape
    values = RISKS[risk](alpha.reshape(k * b, c), y.repeat(k), mask.repeat(k, 1))
    return values.reshape(k, b).mean(0)


def vid_loss(alpha: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """VID: psi(alpha0) - psi(alpha_y) + KL(Dir(alpha) || Dir(y * sg(alpha) + (1 - y))).

    References:
        Chen et al. A Variational Dirichlet Framework for Out-of-Distribution Detection. 2018.
    """
    target = one_hot(y, mask)
    prior = target * alpha.detach().float() + (1 - target)
    return digamma_ce_risk(alpha, y, mask) + dirichlet_kl(alpha, prior, mask)


def annealing(epoch: int, epochs: float, lam: float = 1.0) -> float:
    """lambda_t = lam * min(1, epoch / epochs), constant within an epoch (Sensoy's annealing as the reference
    code applies it: ``UpdateRegWeightCallback.on_epoch_begin`` sets min(1, epoch / num_epochs) at each epoch's
    start, so the KL term is off for the whole first epoch)."""
    if lam < 0:
        raise ValueError(f"lambda must be >= 0, got {lam}")
    if not epochs > 0:
        raise ValueError(f"epochs must be > 0, got {epochs}")
    return lam * min(1.0, max(0, epoch) / epochs)


def fisher_mse(alpha: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """I-EDL's Fisher-weighted MSE and the log-determinant of the Dirichlet's Fisher information.

    Returns (risk, log_det): risk = sum_j psi1(alpha_j) ((y_j - p_j)^2 + p_j (1 - p_j) / (alpha0 + 1)),
    log_det = sum_j log psi1(alpha_j) + log(1 - psi1(alpha0) sum_j 1 / psi1(alpha_j)), both (B,).

    References:
        Deng et al. Uncertainty Estimation by Fisher Information-based Evidential Deep Learning. ICML 2023.
    """
    target = one_hot(y, mask)
    a = torch.where(mask, alpha.float(), torch.ones((), device=alpha.device))
    a0 = (a * mask).sum(-1, keepdim=True)
    p = a * mask / a0
    trigamma = torch.polygamma(1, a)
    trigamma0 = torch.polygamma(1, a0)
    risk = (trigamma * ((target - p) ** 2 + p * (1 - p) / (a0 + 1)) * mask).sum(-1)
    ratio = ((trigamma0 / trigamma) * mask).sum(-1)
    log_det = (torch.log(trigamma) * mask).sum(-1) + torch.log((1.0 - ratio).clamp_min(1e-12))
    return risk, log_det


def relaxed_mse(alpha: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """R-EDL's risk: sum_j (y_j - alpha_j / alpha0)^2 with alpha = evidence + eta, no variance term.

    References:
        Chen et al. R-EDL: Relaxing Nonessential Settings of Evidential Deep Learning. ICLR 2024.
    """
    return mse_bayes_risk(alpha, y, mask, variance=False)


def wrong_evidence_kl(alpha: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, prior: float = 1.0) -> torch.Tensor:
    """KL(Dir(alpha~) || Dir(prior)) with alpha~ = prior on the target, alpha elsewhere (EDL's regulariser
    for a prior count ``prior``: 1 for EDL and I-EDL, eta for R-EDL)."""
    target = one_hot(y, mask)
    alpha_tilde = target * prior + (1 - target) * alpha.float()
    return dirichlet_kl(alpha_tilde, torch.full_like(alpha_tilde, prior), mask)
