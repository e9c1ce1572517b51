"""Each head kind's post-hoc step, one object per kind: the parameter it fits after training (``zeta`` for IB-EDL,
``temperature`` for softmax heads, none for the plain evidential head), how it is fitted on calibration questions,
and how raw head outputs become the predictive outputs with it, in float64 for calibration's decisions and in
float32 as the served head computes them. Calibration (ibedl.training.calibrate) asks the kind object; nothing
outside this module branches on a head kind.

Both parameters are chosen on a grid by NLL. IB-EDL's (paper appendix): alpha <- max(alpha - zeta * sigma, offset),
zeta may be negative (an under-confident model); softmax heads': softmax(log p / T). The maps themselves are the
head's (ibedl.core.head.adjust_alpha and temper); this module pads per-question outputs into tensors for them.

Raw outputs (``raw``): ``probs`` (N rows of (C_i,) probabilities), and for a Dirichlet head ``alpha`` (N rows of
(C_i,) concentrations with the post-hoc step neutral), ``sigma`` (IB-EDL: N rows of (C_i,) spreads, else None) and
``offset`` (alpha's floor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ibedl.core.dirichlet import dirichlet_outputs
from ibedl.core.head import POSTHOC_KEYS, POSTHOC_NEUTRAL, adjust_alpha, temper_logits
from ibedl.core.head import temper as head_temper

ZETA_GRID = tuple(np.round(np.arange(-10.0, 10.01, 0.25), 2))
TEMPERATURE_GRID = tuple(float(t) for t in np.round(np.exp(np.linspace(np.log(0.05), np.log(20.0), 241)), 6))


@dataclass
class Outputs:
    """Predictive quantities of N questions after the post-hoc step.

    Attributes:
        probs: N rows of (C_i,) probabilities.
        uncertainty: (N,) u = C / alpha0, or None without a Dirichlet.
    """

    probs: list[np.ndarray]
    uncertainty: np.ndarray | None = None
    extra: dict = field(default_factory=dict)

    @property
    def confidence(self) -> np.ndarray:
        return np.asarray([p.max() for p in self.probs])

    def ood_score(self) -> np.ndarray:
        """(N,) in-distribution score, higher = more typical: 1/u with a Dirichlet, max p without."""
        return 1.0 / self.uncertainty if self.uncertainty is not None else self.confidence


def padded(rows, fill: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-question (C_i,) rows -> a float64 (N, max C) tensor padded with ``fill`` and its (N, max C) mask."""
    width = max(len(r) for r in rows)
    values = torch.full((len(rows), width), fill, dtype=torch.float64)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        values[i, : len(r)] = torch.as_tensor(np.asarray(r, dtype=np.float64))
        mask[i, : len(r)] = True
    return values, mask


def adjusted_alphas(alphas, sigmas, zeta: float, offset: float = 1.0) -> list[np.ndarray]:
    """Per-question (C_i,) float64 alpha after the head's post-hoc map with ``zeta``."""
    alpha, _ = padded(alphas, offset)
    sigma, _ = padded(sigmas)
    out = adjust_alpha(alpha, sigma, zeta, offset).numpy()
    return [out[i, : len(a)] for i, a in enumerate(alphas)]


def _nll(adjusted: list[np.ndarray], labels) -> float:
    total = 0.0
    for adj, y in zip(adjusted, labels, strict=True):
        total -= math.log(max(adj[y] / adj.sum(), 1e-12))
    return total / len(labels)


def fit_zeta(alphas, sigmas, labels, grid=ZETA_GRID, offset: float = 1.0) -> tuple[float, dict]:
    """The grid value of zeta with the lowest validation NLL (0 wins ties). Returns (zeta, info).

    Args:
        alphas, sigmas: per-question (C,) arrays from the head with zeta = 0.
        labels: (N,) answer indices.
    """
    if not len(labels):
        raise ValueError("fit_zeta needs at least one labelled question")
    alpha, mask = padded(alphas, offset)
    sigma, _ = padded(sigmas)
    widths = mask.sum(-1).tolist()

    def nll(zeta: float) -> float:
        out = adjust_alpha(alpha, sigma, zeta, offset).numpy()
        return _nll([out[i, :n] for i, n in enumerate(widths)], labels)

    scores = {float(z): nll(float(z)) for z in grid}
    best = min(scores, key=lambda z: (round(scores[z], 12), abs(z)))
    return best, {"criterion": "validation NLL", "nll_at_0": nll(0.0), "nll_at_zeta": scores[best],
                  "grid": [min(grid), max(grid), len(grid)]}


def dirichlet(alphas: list[np.ndarray], offset: float) -> Outputs:
    """Probabilities alpha / alpha0 and u = C * offset / alpha0 (ibedl.core.dirichlet.dirichlet_outputs)."""
    probs = [a / a.sum() for a in alphas]
    return Outputs(probs, np.asarray([len(a) * offset / a.sum() for a in alphas]))


def temper(probs: list[np.ndarray], temperature: float) -> list[np.ndarray]:
    """softmax(log p / T) per question, in float64: the softmax heads' post-hoc map (ibedl.core.head.temper)."""
    values, mask = padded(probs)
    out = head_temper(values, mask, temperature).numpy()
    return [out[i, : len(p)] for i, p in enumerate(probs)]


def fit_temperature(probs: list[np.ndarray], labels, grid=TEMPERATURE_GRID) -> tuple[float, dict]:
    """The grid temperature with the lowest NLL of softmax(log p / T) (T = 1 wins ties). Returns (T, info).
    The tempered log-probabilities are the head's map's (ibedl.core.head.temper_logits)."""
    if not len(labels):
        raise ValueError("fit_temperature needs at least one labelled question")
    values, mask = padded(probs)
    y = torch.as_tensor(np.asarray(labels), dtype=torch.long)

    def nll(t: float) -> float:
        z = temper_logits(values, mask, t)
        return float((torch.logsumexp(z, dim=1) - z[torch.arange(len(y)), y]).mean())

    scores = {t: nll(t) for t in (*grid, 1.0)}
    best = min(scores, key=lambda t: (round(scores[t], 12), abs(math.log(t))))
    return best, {"criterion": "NLL on the fit part", "nll_at_1": scores[1.0], "nll_at_temperature": scores[best],
                  "grid": [min(grid), max(grid), len(grid)]}


class Evidential:
    """A Dirichlet head without a post-hoc step: alpha as the head gives it."""

    name = "evidential"

    @property
    def key(self) -> str | None:
        """The head config's post-hoc parameter (ibedl.core.head.POSTHOC_KEYS), None without a step."""
        return POSTHOC_KEYS.get(self.name)

    def neutral(self) -> dict:
        """The head update that leaves the outputs unchanged (what the thresholds assume without the step)."""
        return {} if self.key is None else {self.key: POSTHOC_NEUTRAL[self.key]}

    def fit(self, raw: dict, labels: np.ndarray, idx: np.ndarray) -> tuple[dict, dict]:
        """(head update, record) of the post-hoc step fitted on questions ``idx``; neutral without one."""
        return self.neutral(), {"kind": None}

    def alphas(self, raw: dict, update: dict) -> list[np.ndarray]:
        return [np.asarray(a, dtype=np.float64) for a in raw["alpha"]]

    def outputs(self, raw: dict, update: dict) -> Outputs:
        """Predictive outputs with the head ``update`` applied, in float64 (calibration's decisions)."""
        return dirichlet(self.alphas(raw, update), raw["offset"])

    def served_alpha(self, alpha: torch.Tensor, raw: dict, update: dict) -> torch.Tensor:
        """(N, max C) float32 alpha as the head serves it with ``update`` set, from the padded raw alpha."""
        return alpha

    def served(self, raw: dict, update: dict) -> Outputs:
        """What the head answers with ``update`` set, in float32 as its forward pass computes it."""
        offset = raw["offset"]
        alpha, mask = padded(raw["alpha"], offset)
        out = dirichlet_outputs(self.served_alpha(alpha.float(), raw, update), mask, offset)
        probs = out.probs.double().numpy()
        return Outputs([probs[i, : len(a)] for i, a in enumerate(raw["alpha"])], out.uncertainty.double().numpy())


class IBEDL(Evidential):
    """IB-EDL's head: alpha <- max(alpha - zeta * sigma, offset), zeta fitted by NLL (:func:`fit_zeta`)."""

    name = "ib_edl"

    def fit(self, raw: dict, labels: np.ndarray, idx: np.ndarray) -> tuple[dict, dict]:
        zeta, info = fit_zeta([np.asarray(raw["alpha"][i], dtype=np.float64) for i in idx],
                              [np.asarray(raw["sigma"][i], dtype=np.float64) for i in idx], labels[idx],
                              offset=raw["offset"])
        return {"zeta": zeta}, {"kind": "zeta", "zeta": zeta, **info}

    def alphas(self, raw: dict, update: dict) -> list[np.ndarray]:
        alphas = super().alphas(raw, update)
        zeta = update.get("zeta", 0.0)
        return adjusted_alphas(alphas, raw["sigma"], zeta, raw["offset"]) if zeta else alphas

    def served_alpha(self, alpha: torch.Tensor, raw: dict, update: dict) -> torch.Tensor:
        sigma, _ = padded(raw["sigma"])
        return adjust_alpha(alpha, sigma.float(), update.get("zeta", 0.0), raw["offset"])


class Softmax(Evidential):
    """A softmax head: softmax(log p / T), the temperature fitted by NLL."""

    name = "softmax"

    def fit(self, raw: dict, labels: np.ndarray, idx: np.ndarray) -> tuple[dict, dict]:
        t, info = fit_temperature([np.asarray(raw["probs"][i], dtype=np.float64) for i in idx], labels[idx])
        return {"temperature": t}, {"kind": "temperature", "temperature": t, **info}

    def outputs(self, raw: dict, update: dict) -> Outputs:
        probs = [np.asarray(p, dtype=np.float64) for p in raw["probs"]]
        t = update.get("temperature", 1.0)
        return Outputs(temper(probs, t) if t != 1.0 else probs)

    def served(self, raw: dict, update: dict) -> Outputs:
        probs, mask = padded(raw["probs"])
        out = head_temper(probs.float(), mask, update.get("temperature", 1.0)).double().numpy()
        return Outputs([out[i, : len(p)] for i, p in enumerate(raw["probs"])])


KINDS = {k.name: k for k in (Softmax(), Evidential(), IBEDL())}  # one line per head kind


def head_kind(name: str) -> Evidential:
    """The head kind called ``name`` (ValueError naming the known ones otherwise)."""
    if name not in KINDS:
        raise ValueError(f"unknown head kind {name!r}; known: {sorted(KINDS)}")
    return KINDS[name]


def served_kind(declared: str, raw: dict) -> str:
    """The kind raw outputs can be calibrated as: the declared head's, unless they lack what it needs (an IB-EDL
    head without sigma is calibrated as evidential; outputs without alpha, such as an ensemble of Dirichlet members
    averaged, as softmax)."""
    if declared == IBEDL.name and raw.get("sigma") is None:
        declared = Evidential.name
    if declared != Softmax.name and "alpha" not in raw:
        declared = Softmax.name
    return declared
