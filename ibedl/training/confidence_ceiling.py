"""The highest confidence IB-EDL's objective lets a question reach, as a function of beta.

    python -m ibedl.training.confidence_ceiling [--beta 1e-3 1e-4 ...] [--options 4] [--risk mse nll]

For a training question the model has learnt perfectly (its features can put any pre-evidence on
any option), IB-EDL minimises ``risk(softplus(mu) + 1, y) + beta / 2 * sum_j mu_j^2`` over ``mu``.
The information term charges for evidence, so the minimiser stops short of certainty: its
``p_y = alpha_y / alpha0`` is the *ceiling* on the confidence the adapter is trained towards, whatever
the data. With four options and the MSE risk, beta = 1e-3 (the paper's ARC-C value) caps it at about
0.79: an adapter whose easy questions deserve 0.99 is then under-confident by construction, which is
what the default adapter's first version showed (mean confidence 0.71 at 80% accuracy).

This is the noise-free ceiling (sigma -> 0). With sigma > 0 the sampled risk is flatter and the
ceiling lower, so the numbers here are upper bounds.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ibedl.training.losses import RISKS


@dataclass(frozen=True)
class Ceiling:
    """The minimiser of one perfectly learnt question's IB-EDL objective.

    Attributes:
        confidence: p_y = alpha_y / alpha0 at the minimiser.
        strength: alpha0 there.
        mu_correct, mu_other: pre-evidence of the correct option and of each other option.
    """

    beta: float
    num_options: int
    risk: str
    confidence: float
    strength: float
    mu_correct: float
    mu_other: float


def objective(mu: torch.Tensor, beta: float, risk: str) -> torch.Tensor:
    """risk(softplus(mu) + 1, y = 0) + beta / 2 * ||mu||^2 for mu: (B, C); returns (B,)."""
    mask = torch.ones_like(mu, dtype=torch.bool)
    y = torch.zeros(mu.shape[0], dtype=torch.long)
    alpha = F.softplus(mu) + 1.0
    return RISKS[risk](alpha, y, mask) + 0.5 * beta * (mu**2).sum(-1)


def confidence_ceiling(beta: float, num_options: int = 4, risk: str = "mse") -> Ceiling:
    """Minimise the per-question objective; by symmetry the wrong options share one pre-evidence.

    Args:
        beta: information weight, > 0 (at 0 the ceiling is 1: no minimiser exists).
        num_options: C, 2..26.
        risk: ``mse`` or ``nll`` (``ibedl.training.losses``).
    """
    if not (isinstance(beta, (int, float)) and beta > 0 and math.isfinite(beta)):
        raise ValueError(f"beta must be a finite number > 0, got {beta!r}")
    if not 2 <= num_options <= 26:
        raise ValueError(f"num_options must be in 2..26, got {num_options}")
    if risk not in RISKS:
        raise ValueError(f"risk must be one of {sorted(RISKS)}, got {risk!r}")
    # (mu_correct, mu_other), in float64; LBFGS from a start on the right side of both optima.
    params = torch.tensor([5.0, -1.0], dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([params], lr=1.0, max_iter=500, tolerance_grad=1e-13, tolerance_change=1e-16,
                                  line_search_fn="strong_wolfe")

    def full() -> torch.Tensor:
        return torch.cat([params[:1], params[1:].expand(num_options - 1)]).unsqueeze(0)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        value = objective(full(), beta, risk).sum()
        value.backward()
        return value

    for _ in range(20):
        optimizer.step(closure)
        if params.grad is not None and params.grad.abs().max() < 1e-10:
            break
    with torch.no_grad():
        alpha = F.softplus(full()) + 1.0
        a0 = alpha.sum()
        return Ceiling(beta=float(beta), num_options=num_options, risk=risk,
                       confidence=float(alpha[0, 0] / a0), strength=float(a0),
                       mu_correct=float(params[0]), mu_other=float(params[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ibedl.training.confidence_ceiling",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--beta", type=float, nargs="+", default=[1e-2, 1e-3, 3e-4, 1e-4, 1e-5, 1e-6])
    parser.add_argument("--options", type=int, default=4, help="number of options C (default 4)")
    parser.add_argument("--risk", nargs="+", default=["mse", "nll"], help="mse and/or nll")
    args = parser.parse_args(argv)
    try:
        rows = [confidence_ceiling(b, args.options, r) for r in args.risk for b in args.beta]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{'risk':<5} {'beta':>8} {'ceiling p_y':>12} {'alpha0':>9} {'mu_y':>8} {'mu_other':>9}")
    for c in rows:
        print(f"{c.risk:<5} {c.beta:>8.0e} {c.confidence:>12.4f} {c.strength:>9.2f} {c.mu_correct:>8.2f} "
              f"{c.mu_other:>9.2f}")
    return 0


__all__ = ["Ceiling", "confidence_ceiling", "objective"]

if __name__ == "__main__":
    sys.exit(main())
