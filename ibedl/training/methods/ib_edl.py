"""IB-EDL: a Gaussian over pre-evidence; the K-sample Bayes risk plus beta times KL(N(mu, sigma^2) || N(0, 1)).

``risk`` picks the paper's expected loss under the sampled pre-evidence: ``mse`` (eq. L_IB-MSE, the
paper's default) or ``nll`` (eq. L_IB-NLL: log alpha0 - log alpha_y, the exact -log p(y | z)).

``sigma_constant`` (off by default) is the ablation of the learned sigma: training samples e~ = mu + c * eps with this
constant c for every option and question (the sigma head gets no gradient and stays as initialised).
``sigma_frozen`` (off by default) is the other ablation: the sigma head keeps its initialisation (a copy of the option
rows, its bias centred on the first batch) and gets no gradient, but the loss samples with the sigma it computes, so
sigma still varies with the question as the untrained head makes it vary, and the loss's gradient through sigma still
reaches the LoRA trunk under it (about a sixth of the hidden state's gradient in a helper's measurement): the head's
rows are frozen, not sigma as a function of the question.
``inference`` (``mean`` by default: softplus(mu), one pass, the K -> infinity limit of the paper's Algorithm 1, which
averages the sampled pre-evidences before softplus) sets how the trained head answers: ``sampled`` is the authors' code
(the mean of K = ``inference_samples`` sampled evidences softplus(e~), on one fixed table of draws,
ibedl.core.head.sampling_noise), ``quadrature`` its K -> infinity limit by Gauss-Hermite.

``sigma_init_scale`` and ``sigma_lr_scale`` (1 by default: the paper's initialisation, the head's learning rate) set
the sigma rows' start (scale x the option rows; 0: sigma starts the same for every question and differs between
questions only as training makes it) and its learning rate (factor x ``optim.head_lr``): the search for a setting
in which sigma says something the evidence does not (``benchmarks/sciq_sigma_search.yaml``).

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
from typing import Literal

import torch
from pydantic import StrictBool, model_validator

from ibedl.core.head import INFERENCE
from ibedl.training.confidence_ceiling import confidence_ceiling
from ibedl.training.losses import RISKS, gaussian_information, ib_edl_risk
from ibedl.training.methods.base import Hyper, Method, Number, StrictInt, count, number


class IBEDLParams(Hyper):
    beta: Number = number(1e-3, ge=0)  # weight of the information term
    num_samples: StrictInt = count(20)  # K samples of the pre-evidence per question in training
    risk: Literal[tuple(RISKS)] = "mse"
    beta_start: Number | None = number(None, gt=0)  # anneal beta log-linearly from this to beta
    beta_anneal: Number = number(0.5, gt=0, le=1)  # share of training the annealing takes
    sigma_constant: Number | None = number(None, gt=0)  # ablation: a constant sigma instead of the learned one
    sigma_frozen: StrictBool = False  # ablation: the sigma head stays at its initialisation (no gradient)
    sigma_init_scale: Number = number(1.0, ge=0)  # sigma rows start as this x the option rows
    sigma_lr_scale: Number = number(1.0, gt=0)  # the sigma head trains at this x optim.head_lr
    inference: Literal[INFERENCE] = "mean"  # the head's pre-evidence estimate when it answers (HeadConfig.inference)
    inference_samples: StrictInt = count(20)  # K draws of ``sampled`` inference

    @model_validator(mode="after")
    def _anneal(self):
        if self.beta_start is not None and not self.beta > 0:
            raise ValueError("method_params.beta_start needs beta > 0 to anneal to (log-linear), "
                             f"got beta {self.beta!r}")
        return self


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
    hyper=IBEDLParams,
    # Neither ablation trains the sigma head; with sigma_constant the loss does not even read it, and DDP refuses a
    # trainable parameter that no loss reached (its reducer fails at the second step).
    frozen=lambda params: (("sigma_weight", "sigma_bias")
                           if params["sigma_frozen"] or params["sigma_constant"] is not None else ()),
    head_options=lambda params: {"sigma_init_scale": float(params["sigma_init_scale"]),
                                 "inference": params["inference"], "inference_samples": params["inference_samples"]},
    lr_scales=lambda params: {"sigma_weight": params["sigma_lr_scale"], "sigma_bias": params["sigma_lr_scale"]},
    clip_grad_norm=20.0,
    confidence_ceiling=ceiling,
    calibrates_posthoc=True,
)
