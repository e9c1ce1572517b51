"""Post-hoc calibration of IB-EDL (paper appendix): alpha <- max(alpha - zeta * sigma, offset), zeta fitted
on validation data by minimising NLL over a grid (zeta may be negative: an under-confident model).

The map itself is the head's (:func:`ibedl.core.head.adjust_alpha`, used by ``IBEDLHead.forward``); this module
only pads per-question outputs into tensors for it and searches the grid."""

from __future__ import annotations

import math

import numpy as np
import torch

from ibedl.core.head import adjust_alpha

ZETA_GRID = tuple(np.round(np.arange(-10.0, 10.01, 0.25), 2))


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
