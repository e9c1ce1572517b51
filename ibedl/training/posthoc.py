"""Post-hoc calibration of IB-EDL (paper appendix): alpha <- max(alpha - zeta * sigma, 1), zeta fitted
on validation data by minimising NLL over a grid (zeta may be negative: an under-confident model)."""

from __future__ import annotations

import math

import numpy as np

ZETA_GRID = tuple(np.round(np.arange(-10.0, 10.01, 0.25), 2))


def adjust_alpha(alpha: np.ndarray, sigma: np.ndarray, zeta: float, offset: float = 1.0) -> np.ndarray:
    """alpha: (C,), sigma: (C,) -> max(alpha - zeta * sigma, offset)."""
    return np.maximum(np.asarray(alpha, dtype=np.float64) - zeta * np.asarray(sigma, dtype=np.float64), offset)


def nll_with_zeta(alphas, sigmas, labels, zeta: float, offset: float = 1.0) -> float:
    total = 0.0
    for a, s, y in zip(alphas, sigmas, labels):
        adj = adjust_alpha(a, s, zeta, offset)
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
    scores = {float(z): nll_with_zeta(alphas, sigmas, labels, float(z), offset) for z in grid}
    best = min(scores, key=lambda z: (round(scores[z], 12), abs(z)))
    return best, {"criterion": "validation NLL", "nll_at_0": nll_with_zeta(alphas, sigmas, labels, 0.0, offset),
                  "nll_at_zeta": scores[best], "grid": [min(grid), max(grid), len(grid)]}
