"""IB-EDL: a Gaussian over pre-evidence; the K-sample Bayes risk plus beta times KL(N(mu, sigma^2) || N(0, 1)).

``risk`` picks the paper's expected loss under the sampled pre-evidence: ``mse`` (eq. L_IB-MSE, the
paper's default) or ``nll`` (eq. L_IB-NLL: log alpha0 - log alpha_y, the exact -log p(y | z)).

``sigma_constant`` (off by default) is the ablation of the learned sigma: training samples e~ = mu + c * eps with this
constant c for every option and question (the sigma head gets no gradient and stays as initialised).

``beta_start`` (off by default) anneals the information weight: it starts at ``beta_start`` and moves
log-linearly to ``beta`` over the first ``beta_anneal`` fraction of training, then stays at ``beta``.
Why: while the model is still at chance, the Dirichlet mean is flattened most cheaply by raising every
option's evidence together (alpha0 7 -> 50 within 20 steps at beta 1e-5, NLL risk); a strong bottleneck
early holds alpha0 down, a weak one late lifts the confidence ceiling (``ibedl.training.confidence_ceiling``).

References:
    Li et al. Calibrating LLMs with Information-Theoretic Evidential Deep Learning. ICLR 2025, Algorithm 1.
"""

import math
from dataclasses import asdict

import torch

from ibedl.training.confidence_ceiling import confidence_ceiling

from ibedl.training.losses import RISKS, gaussian_information, ib_edl_risk
from ibedl.training.methods.base import Method


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_params(params: dict) -> None:
    """Raise ValueError naming the first bad hyper-parameter."""
    if not (_finite(params["beta"]) and params["beta"] >= 0):
        raise ValueError(f"beta must be a finite number >= 0, got {params['beta']!r}")
    if not (isinstance(params["num_samples"], int) and params["num_samples"] >= 1):
        raise ValueError(f"num_samples must be an integer >= 1, got {params['num_samples']!r}")
    if params["risk"] not in RISKS:
        raise ValueError(f"risk must be one of {sorted(RISKS)}, got {params['risk']!r}")
    start = params["beta_start"]
    if start is not None:
        if not (_finite(start) and start > 0):
            raise ValueError(f"beta_start must be a finite number > 0 (or null for a constant beta), got {start!r}")
        if not params["beta"] > 0:
            raise ValueError(f"beta_start needs beta > 0 to anneal to (log-linear), got beta {params['beta']!r}")
    constant = params["sigma_constant"]
    if constant is not None and not (_finite(constant) and constant > 0):
        raise ValueError(
            f"sigma_constant must be a finite number > 0 (or null for the learned sigma), got {constant!r}"
        )
    if not (_finite(params["beta_anneal"]) and 0 < params["beta_anneal"] <= 1):
        raise ValueError(f"beta_anneal must be in (0, 1], got {params['beta_anneal']!r}")


def beta_at(params: dict, progress: float) -> float:
    """The information weight at this fraction of training (``progress`` in [0, 1])."""
    start, end = params["beta_start"], params["beta"]
    if start is None:
        return float(end)
    t = min(max(progress / params["beta_anneal"], 0.0), 1.0)
    return math.exp(math.log(start) + t * (math.log(end) - math.log(start)))


def ceiling(params: dict, num_options: int) -> dict | None:
    """The highest confidence the objective allows at ``num_options`` (``ibedl.training.confidence_ceiling``);
    None without an information term."""
    if not params["beta"] > 0:
        return None
    return asdict(confidence_ceiling(params["beta"], num_options, params["risk"]))


def ib_edl_loss(out, y, mask, params, ctx):
    sigma = out.sigma if params["sigma_constant"] is None else torch.full_like(out.sigma, params["sigma_constant"])
    risk = ib_edl_risk(out.logits, sigma, y, mask, params["num_samples"], ctx.generator, params["risk"])
    info = gaussian_information(out.logits, sigma, mask)
    beta = beta_at(params, ctx.progress)
    return {"loss": risk + beta * info, "risk": risk, "info": info, "beta": torch.full_like(risk, beta)}


METHOD = Method(
    name="ib_edl",
    label="IB-EDL",
    head="ib_edl",
    loss=ib_edl_loss,
    defaults={"beta": 1e-3, "num_samples": 20, "risk": "mse", "beta_start": None, "beta_anneal": 0.5,
              "sigma_constant": None},
    clip_grad_norm=20.0,
    check=check_params,
    confidence_ceiling=ceiling,
    calibrates_posthoc=True,
)
