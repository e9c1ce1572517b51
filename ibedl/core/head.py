"""Option heads: from the last real token's hidden state h (B, d) to the predictive of a question.

Each head holds one row per option letter (A.., initialised from the LM head's rows of " A", " B", ...)
and turns ``h`` into a :class:`HeadPrediction`. A head is saved as safetensors plus a small JSON config
(``HeadConfig``); :data:`HEADS` maps a config's ``kind`` to its class.

Heads:
    ``softmax``    z = W h; probs = softmax(z).  (MAP, MC-Dropout, Ensemble, Laplace)
    ``evidential`` alpha = softplus(s W h + b) + offset (s = ``evidence_scale``, 1 by default).
                   (EDL, VID, I-EDL with offset 1; R-EDL with eta)
    ``ib_edl``     mu = s W_mu h + b_mu, sigma = softplus(W_sigma h + b_sigma); alpha from E[pre-evidence].
                   Both row sets start from the option rows (the paper: both heads from the pretrained LM
                   head); with ``centre_sigma`` the sigma rows are centred over the options like mu's.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import asdict, dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

from ibedl.core.dirichlet import alpha_from_logits, dirichlet_outputs, masked_softmax

SIGMA_FLOOR = 1e-4  # keeps log(sigma) finite in the information term
INFERENCE = ("mean", "quadrature", "sampled")  # IB-EDL's pre-evidence estimates (HeadConfig.inference)
SAMPLING_SEED = 0  # the seed of ``sampled`` inference's one table of draws
HeadKind = Literal["softmax", "evidential", "ib_edl"]
HEAD_KINDS = get_args(HeadKind)


@dataclass
class HeadPrediction:
    """Per-question predictive quantities, padded options zeroed.

    Attributes:
        probs: (B, C) predictive probabilities.
        logits: (B, C) z of a softmax head, pre-evidence of an evidential head, mu of IB-EDL.
        alpha: (B, C) Dirichlet concentration, or None for softmax heads.
        belief: (B, C) belief masses, or None.
        uncertainty: (B,) uncertainty mass u, or None.
        sigma: (B, C) std of the pre-evidence (IB-EDL), or None.
    """

    probs: torch.Tensor
    logits: torch.Tensor
    alpha: torch.Tensor | None = None
    belief: torch.Tensor | None = None
    uncertainty: torch.Tensor | None = None
    sigma: torch.Tensor | None = None


@dataclass
class HeadConfig:
    """What a head needs besides its tensors; stored in the artifact manifest.

    Attributes:
        kind: ``softmax`` | ``evidential`` | ``ib_edl``.
        num_rows: option letters the head scores (A.. up to 26).
        hidden_size: d.
        offset: alpha = evidence + offset (1 for EDL; eta for R-EDL).
        inference: IB-EDL pre-evidence estimate: ``mean`` (E[e~] = mu), ``quadrature`` (Gauss-Hermite
            E[softplus(mu + sigma eps)]) or ``sampled`` (the authors' code at inference: the mean of
            softplus(mu + sigma eps) over ``inference_samples`` draws of eps, where the paper's Algorithm 1 averages
            the draws before softplus, whose limit is ``mean``; the draws are one fixed table
            (:func:`sampling_noise`), so an answer does not change between calls nor with its batch).
        quadrature_points: nodes for ``quadrature``.
        inference_samples: K, the draws of ``sampled``.
        zeta: post-hoc IB-EDL calibration, alpha <- max(alpha - zeta * sigma, offset).
        temperature: post-hoc calibration of methods without a Dirichlet: the predictive probabilities
            (after averaging MC-Dropout passes or ensemble members) become softmax(log p / T). 1 is none.
        sigma_init_scale, sigma_init_bias: IB-EDL's sigma rows start as scale * option rows with this bias.
            The paper initialises both heads from the pretrained LM head (scale 1); training then sets the
            bias from the first batch like mu's (``init_bias_from``), so that sigma starts at softplus(0) ~ 0.69
            in the middle and varies with the question. (The earlier 0.01 x rows with bias -4 kept sigma at
            ~0.018 for every question: the K samples changed nothing; such artifacts still load as they were.)
        centre_sigma: IB-EDL's sigma rows are centred over the question's real options before the bias, as mu's
            are with ``centre_options`` (what tells options apart, not the component all letter rows share).
            Off for artifacts written before it existed.
        centre_options: evidential heads subtract, per question, the mean of W h over its real options
            before the shared bias: pre-evidence then carries only how the options differ, and a change
            of the hidden state that moves every option's letter logit together (the letter rows share
            a component as large as what tells them apart) no longer inflates or collapses every
            option's evidence at once. Off by default (the paper's head).
        evidence_scale: evidential heads multiply W h (after centring, before the shared bias) by this
            fixed s. Softplus evidence grows linearly, so near z = 0 an evidential head's probabilities
            move ~3.4x less per unit of z than a softmax's (dp_y/dz_y = 0.055 against 0.1875 with 4
            options) and p_y = 0.9 needs z ~ 26 where a softmax needs a gap of 3.3; with Adam's fixed
            step size the EDL family then learns later than MAP. s rescales that without touching
            the learning rates. 1 by default (the paper's head); softmax heads ignore it.
    """

    kind: HeadKind
    num_rows: int
    hidden_size: int
    offset: float = 1.0
    inference: Literal["mean", "quadrature", "sampled"] = "mean"
    quadrature_points: int = 16
    inference_samples: int = 20
    zeta: float = 0.0
    temperature: float = 1.0
    sigma_init_scale: float = 1.0
    sigma_init_bias: float = 0.0
    centre_sigma: bool = False
    centre_options: bool = False
    evidence_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in HEAD_KINDS:
            raise ValueError(f"head kind must be one of {sorted(HEAD_KINDS)}, got {self.kind!r}")
        if not 2 <= self.num_rows <= 26:
            raise ValueError(f"num_rows must be in 2..26, got {self.num_rows}")
        if self.hidden_size <= 0:
            raise ValueError(f"hidden_size must be > 0, got {self.hidden_size}")
        if self.offset <= 0:
            raise ValueError(f"offset must be > 0, got {self.offset}")
        if self.inference not in INFERENCE:
            raise ValueError(f"inference must be one of {', '.join(INFERENCE)}, got {self.inference!r}")
        if isinstance(self.inference_samples, bool) or not isinstance(self.inference_samples, int) \
                or self.inference_samples < 1:
            raise ValueError(f"inference_samples must be an integer >= 1, got {self.inference_samples!r}")
        check_evidence_scale(self.evidence_scale)
        if isinstance(self.temperature, bool) or not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")
        if self.temperature != 1.0 and self.kind != "softmax":
            raise ValueError(f"temperature applies to softmax heads only, got {self.temperature} for a {self.kind} "
                             "head")
        if self.quadrature_points < 2:
            raise ValueError(f"quadrature_points must be >= 2, got {self.quadrature_points}")

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def dirichlet(self) -> bool:
        """Whether this kind answers a Dirichlet (belief masses, an uncertainty mass)."""
        return HEADS[self.kind].dirichlet

    @property
    def posthoc_key(self) -> str | None:
        """The post-hoc parameter this head kind owns: ``zeta`` (IB-EDL), ``temperature`` (softmax), or None."""
        return POSTHOC_KEYS.get(self.kind)

    def posthoc_alpha(self, alpha: torch.Tensor, sigma: torch.Tensor, zeta: float | None = None) -> torch.Tensor:
        """IB-EDL's post-hoc map with this config's ``zeta`` (or the one given): :func:`adjust_alpha`."""
        return adjust_alpha(alpha, sigma, self.zeta if zeta is None else zeta, self.offset)

    def posthoc_probs(self, probs: torch.Tensor, mask: torch.Tensor, temperature: float | None = None) -> torch.Tensor:
        """The softmax heads' post-hoc map with this config's ``temperature`` (or the one given): :func:`temper`."""
        return temper(probs, mask, self.temperature if temperature is None else temperature)

    @classmethod
    def from_dict(cls, data: dict) -> HeadConfig:
        """A head config as a manifest stores it (older manifests are migrated first: ibedl.core.artifact)."""
        return cls(**data)


POSTHOC_KEYS = {"ib_edl": "zeta", "softmax": "temperature"}  # head kind -> its post-hoc parameter
POSTHOC_NEUTRAL = {"zeta": 0.0, "temperature": 1.0}  # the values that leave the outputs unchanged


def adjust_alpha(alpha: torch.Tensor, sigma: torch.Tensor, zeta: float, offset: float) -> torch.Tensor:
    """IB-EDL's post-hoc map (paper appendix): alpha <- max(alpha - zeta * sigma, offset), elementwise, in the inputs'
    dtype; zeta = 0 returns ``alpha`` itself. The head's forward pass and calibration's fit both use it."""
    if not zeta:
        return alpha
    return torch.clamp(alpha - zeta * sigma, min=offset)


def temper_logits(probs: torch.Tensor, mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p / T over the real options, -inf on padded ones: (B, C) -> (B, C), in float32 (float64 inputs stay
    float64). Its softmax is :func:`temper`; its log-sum-exp minus the label's entry is the tempered NLL."""
    work = probs.double() if probs.dtype == torch.float64 else probs.float()
    logp = torch.log(work.clamp_min(torch.finfo(torch.float32).tiny)) / temperature
    return logp.masked_fill(~mask, float("-inf"))


def temper(probs: torch.Tensor, mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """The softmax heads' post-hoc map: softmax(log p / T) over the real options, probs (B, C), mask (B, C) ->
    (B, C), padded options 0; T = 1 returns ``probs`` itself. For one softmax head this equals softmax(z / T) of its
    logits z; the predictor applies it after averaging MC-Dropout passes or ensemble members."""
    if temperature == 1.0:
        return probs
    return torch.softmax(temper_logits(probs, mask, temperature), dim=-1).to(probs.dtype)


def check_evidence_scale(value) -> float:
    """``evidence_scale`` must be a finite number > 0; returns it, else ValueError naming the value."""
    if not (isinstance(value, (int, float)) and 0 < value < float("inf")):
        raise ValueError(f"evidence_scale must be a finite number > 0, got {value!r}")
    return value


def _check_rows(rows: torch.Tensor, config: HeadConfig) -> None:
    if rows.shape != (config.num_rows, config.hidden_size):
        raise ValueError(
            f"rows must have shape ({config.num_rows}, {config.hidden_size}), got {tuple(rows.shape)}"
        )


class OptionHead(nn.Module):
    """Base class: scores the first C option rows for a batch of hidden states."""

    weight_name = "weight"  # the (num_rows, d) option rows
    dirichlet = True  # answers a Dirichlet: belief masses and an uncertainty mass
    has_sigma = False  # has spread rows (IB-EDL's sigma), centred with the options when they are
    description = ""  # what the model card says it is

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config

    @classmethod
    def card_lines(cls, config: HeadConfig) -> list[str]:
        """What the model card adds about this kind's inference and post-hoc step (its values in ``config``)."""
        return []

    def _check(self, hidden: torch.Tensor, mask: torch.Tensor) -> int:
        if hidden.dim() != 2 or hidden.shape[1] != self.config.hidden_size:
            raise ValueError(f"hidden must be (B, {self.config.hidden_size}), got {tuple(hidden.shape)}")
        if mask.dim() != 2 or mask.shape[0] != hidden.shape[0]:
            raise ValueError(f"mask must be (B, C) with B={hidden.shape[0]}, got {tuple(mask.shape)}")
        num_options = mask.shape[1]
        if num_options > self.config.num_rows:
            raise ValueError(f"the head scores at most {self.config.num_rows} options, got {num_options}")
        return num_options

    @staticmethod
    def _linear(hidden: torch.Tensor, weight: torch.Tensor, num_options: int) -> torch.Tensor:
        # (B, d) x (C, d)^T -> (B, C), in float32 so that bf16 trunks keep a float32 head.
        return hidden.float() @ weight[:num_options].float().T

    def _centred(self, z: torch.Tensor, mask: torch.Tensor, on: bool | None = None) -> torch.Tensor:
        """z: (B, C) -> z minus its mean over each row's real options when ``on`` (default ``centre_options``)."""
        if not (self.config.centre_options if on is None else on):
            return z
        real = mask.to(z.dtype)
        return z - (z * real).sum(-1, keepdim=True) / real.sum(-1, keepdim=True).clamp_min(1.0)

    def _evidence_term(self, hidden: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """hidden: (B, d), mask: (B, C) -> s * centred(W h): (B, C), the pre-evidence before its bias."""
        return self._centred(self._linear(hidden, weight, self._check(hidden, mask)), mask) * self.config.evidence_scale

    @abstractmethod
    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> HeadPrediction:
        """hidden: (B, d) last-token states; mask: (B, C) real options."""


class CentredEvidence:
    """Mixin for heads with a shared pre-evidence bias: ``init_bias_from`` centres the pre-evidence."""

    weight_name = "weight"
    bias_name = "bias"

    @torch.no_grad()
    def init_bias_from(self, hidden: torch.Tensor, mask: torch.Tensor) -> float:
        """Set the bias so that the mean pre-evidence over real options of this batch is 0. Returns it."""
        z = self._evidence_term(hidden, getattr(self, self.weight_name), mask)
        return self.set_bias(-(z * mask).sum().item() / mask.sum().item())

    @torch.no_grad()
    def set_bias(self, value: float) -> float:
        bias = getattr(self, self.bias_name)
        bias.fill_(value)
        return float(bias)


class SoftmaxHead(OptionHead):
    """z = W h over the option rows; probs = softmax(z). No Dirichlet, no uncertainty mass."""

    dirichlet = False
    description = "a softmax over the option letters' rows of the LM head (fine-tuned)"

    @classmethod
    def card_lines(cls, config: HeadConfig) -> list[str]:
        return [f"- Post-hoc temperature {config.temperature:.4g}."] if config.temperature != 1.0 else []

    def __init__(self, config: HeadConfig, rows: torch.Tensor | None = None) -> None:
        super().__init__(config)
        init = torch.zeros(config.num_rows, config.hidden_size) if rows is None else rows.detach().float().clone()
        _check_rows(init, config)
        self.weight = nn.Parameter(init)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> HeadPrediction:
        """hidden: (B, d); mask: (B, C) real options."""
        logits = self._linear(hidden, self.weight, self._check(hidden, mask))
        logits = logits.masked_fill(~mask, 0.0)
        return HeadPrediction(probs=masked_softmax(logits, mask), logits=logits)


class EvidentialHead(CentredEvidence, OptionHead):
    """Pre-evidence z = W h + b; alpha = softplus(z) + offset.

    The shared bias b is what makes the EDL family start near "no evidence": the pretrained letter
    logits of these models sit around +17 for every option (alpha ~ 18, u ~ 0.05 before any
    training), while the Dirichlet prior assumes pre-evidence of order 1. Training sets b from the
    first batch (``init_bias_from``).
    """

    description = "a Dirichlet (evidential) head on the option letters' rows: alpha = softplus(pre-evidence) + offset"

    def __init__(self, config: HeadConfig, rows: torch.Tensor | None = None) -> None:
        super().__init__(config)
        init = torch.zeros(config.num_rows, config.hidden_size) if rows is None else rows.detach().float().clone()
        _check_rows(init, config)
        self.weight = nn.Parameter(init)
        self.bias = nn.Parameter(torch.zeros(()))

    def pre_evidence(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, d) -> (B, C) pre-evidence z, padded entries 0."""
        z = self._evidence_term(hidden, self.weight, mask) + self.bias.float()
        return z.masked_fill(~mask, 0.0)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> HeadPrediction:
        logits = self.pre_evidence(hidden, mask)
        out = dirichlet_outputs(alpha_from_logits(logits, self.config.offset), mask, self.config.offset)
        return HeadPrediction(
            probs=out.probs, logits=logits, alpha=out.alpha, belief=out.belief, uncertainty=out.uncertainty
        )



def sampling_noise(samples: int, options: int, device=None) -> torch.Tensor:
    """(K, C) standard normal draws of ``sampled`` inference: the first C columns of one table drawn with
    ``SAMPLING_SEED`` (26 columns, the most options a head scores), so every question, alone or in any batch, is
    answered with the same draws: a K-sample Monte Carlo estimate per question, reproducible on every call."""
    table = torch.randn((samples, 26), generator=torch.Generator().manual_seed(SAMPLING_SEED))
    return table[:, :options].to(device)


def gauss_hermite(num_points: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Nodes x and weights w with E_{eps~N(0,1)}[f(eps)] ~ sum_i w_i f(x_i) (probabilists' form)."""
    # Golub-Welsch: eigenvalues of the Jacobi matrix of the probabilists' Hermite polynomials.
    k = torch.arange(1, num_points, dtype=torch.float64)
    jacobi = torch.diag(k.sqrt(), 1) + torch.diag(k.sqrt(), -1)
    nodes, vectors = torch.linalg.eigh(jacobi)
    weights = vectors[0] ** 2
    return nodes.float().to(device), (weights / weights.sum()).float().to(device)


class IBEDLHead(CentredEvidence, OptionHead):
    """IB-EDL: a Gaussian over pre-evidence, e~ ~ N(mu, diag(sigma^2)), mu and sigma from h.

    Training samples e~ (see ``ibedl.training.losses``); inference is deterministic: alpha =
    softplus(E[e~]) + 1 = softplus(mu) + 1 (``mean``, this project's default), E[softplus(e~)] + 1 by
    Gauss-Hermite quadrature (``quadrature``), or the mean of K sampled softplus(e~) + 1 (``sampled``: the authors'
    code, on one fixed table of draws; the paper's Algorithm 1 averages e~ first, whose limit is ``mean``).
    Post-hoc zeta then gives alpha <- max(alpha - zeta * sigma, 1).
    """

    weight_name = "mu_weight"
    bias_name = "mu_bias"
    has_sigma = True
    description = ("an IB-EDL head: a Gaussian over each option's pre-evidence (mean and spread rows), "
                   "alpha = E[softplus] + offset")

    @classmethod
    def card_lines(cls, config: HeadConfig) -> list[str]:
        return [f"- IB-EDL inference `{config.inference}`, post-hoc zeta {config.zeta:.4g}."]

    def __init__(self, config: HeadConfig, rows: torch.Tensor | None = None) -> None:
        super().__init__(config)
        init = torch.zeros(config.num_rows, config.hidden_size) if rows is None else rows.detach().float().clone()
        _check_rows(init, config)
        self.mu_weight = nn.Parameter(init.clone())
        self.mu_bias = nn.Parameter(torch.zeros(()))
        self.sigma_weight = nn.Parameter(init.clone() * config.sigma_init_scale)
        self.sigma_bias = nn.Parameter(torch.full((), float(config.sigma_init_bias)))

    def _sigma_term(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, d) -> (B, C) W_sigma h, centred over real options with ``centre_sigma``; before its bias."""
        raw = self._linear(hidden, self.sigma_weight, self._check(hidden, mask))
        return self._centred(raw, mask, self.config.centre_sigma)

    def gaussian(self, hidden: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, d) -> mu (B, C), sigma (B, C) >= SIGMA_FLOOR; padded entries mu 0, sigma 1."""
        mu = self._evidence_term(hidden, self.mu_weight, mask) + self.mu_bias.float()
        sigma = F.softplus(self._sigma_term(hidden, mask) + self.sigma_bias.float()) + SIGMA_FLOOR
        return mu.masked_fill(~mask, 0.0), sigma.masked_fill(~mask, 1.0)

    @torch.no_grad()
    def init_bias_from(self, hidden: torch.Tensor, mask: torch.Tensor) -> float:
        """Centre mu's pre-evidence (as every evidential head) and sigma's pre-activation on this batch: the mean of
        W_sigma h + b_sigma over real options becomes 0, so sigma starts at softplus(0) ~ 0.69 on average and
        varies with the question. Returns mu's bias."""
        raw = self._sigma_term(hidden, mask)
        self.sigma_bias.fill_(-(raw * mask).sum().item() / mask.sum().item())
        return super().init_bias_from(hidden, mask)

    def expected_evidence(self, mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """Deterministic evidence estimate, (B, C)."""
        if self.config.inference == "mean":
            return F.softplus(mu)
        if self.config.inference == "sampled":  # (K, 1, C) draws shared by every question of the batch
            eps = sampling_noise(self.config.inference_samples, mu.shape[-1], mu.device).unsqueeze(1)
            return F.softplus(mu.float() + sigma.float() * eps).mean(0)
        nodes, weights = gauss_hermite(self.config.quadrature_points, mu.device)
        samples = mu.unsqueeze(-1) + sigma.unsqueeze(-1) * nodes  # (B, C, Q)
        return (F.softplus(samples) * weights).sum(-1)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> HeadPrediction:
        mu, sigma = self.gaussian(hidden, mask)
        offset = self.config.offset
        alpha = self.expected_evidence(mu, sigma) + offset
        alpha = self.config.posthoc_alpha(alpha, sigma)
        out = dirichlet_outputs(alpha, mask, offset)
        return HeadPrediction(
            probs=out.probs,
            logits=mu,
            alpha=out.alpha,
            belief=out.belief,
            uncertainty=out.uncertainty,
            sigma=sigma.masked_fill(~mask, 0.0),
        )


HEADS: dict[str, type[OptionHead]] = {
    "softmax": SoftmaxHead,
    "evidential": EvidentialHead,
    "ib_edl": IBEDLHead,
}


def build_head(config: HeadConfig, rows: torch.Tensor | None = None) -> OptionHead:
    """A head of ``config.kind``, its rows initialised from ``rows: (num_rows, d)`` when given."""
    return HEADS[config.kind](config, rows)


__all__ = [
    "HEADS",
    "HeadConfig",
    "HeadPrediction",
    "OptionHead",
    "SoftmaxHead",
    "EvidentialHead",
    "IBEDLHead",
    "build_head",
    "check_evidence_scale",
    "adjust_alpha",
    "temper",
    "temper_logits",
    "POSTHOC_KEYS",
    "POSTHOC_NEUTRAL",
    "gauss_hermite",
    "SIGMA_FLOOR",
]
