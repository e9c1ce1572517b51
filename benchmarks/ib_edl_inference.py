"""IB-EDL's inference choices measured on a trained run's validation questions (never the test split).

    python -m benchmarks.ib_edl_inference --artifact runs/search/sciq_grid/ib_edl-1 [--samples 20]
        [--output benchmarks/results/ib_edl_inference.json]

The head's Gaussian over pre-evidence, N(mu, sigma^2), becomes a Dirichlet in one of three ways:
- ``mean``: alpha = softplus(mu) + 1, deterministic (this project's default: one forward pass, the K -> infinity
  limit of the pre-evidence average);
- ``quadrature``: alpha = E[softplus(mu + sigma eps)] + 1 by 16-point Gauss-Hermite (deterministic, sigma counts);
- ``sampled``: the authors' code, the mean of K sampled alpha (K = 20, fixed seeds; a different answer per call).
Each with the artifact's fitted zeta and with zeta = 0. Reported: accuracy, ECE, NLL, Brier, mean confidence, and
the per-question sigma's median, IQR and coefficient of variation.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from benchmarks.common import write_result
from ibedl.core.dirichlet import dirichlet_outputs
from ibedl.core.head import gauss_hermite
from ibedl.core.predictor import Predictor
from ibedl.training import metrics
from ibedl.training.experiments.evaluate_run import sigma_summary

MODES = ("mean", "quadrature", "sampled")


def alphas(mu: torch.Tensor, sigma: torch.Tensor, mode: str, samples: int = 20, seed: int = 0) -> torch.Tensor:
    """mu, sigma: (B, C) -> alpha (B, C) before zeta, offset 1."""
    if mode == "mean":
        evidence = F.softplus(mu)
    elif mode == "quadrature":
        nodes, weights = gauss_hermite(16)
        evidence = (F.softplus(mu.unsqueeze(-1) + sigma.unsqueeze(-1) * nodes) * weights).sum(-1)
    elif mode == "sampled":
        eps = torch.randn((samples, *mu.shape), generator=torch.Generator().manual_seed(seed))
        evidence = F.softplus(mu + sigma * eps).mean(0)
    else:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return evidence + 1.0


@torch.no_grad()
def gaussians(predictor: Predictor, questions, batch_size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per question, its (C,) mu and sigma."""
    predictor.eval()
    out = []
    for start in range(0, len(questions), batch_size):
        batch = predictor.encode(questions[start : start + batch_size])
        mask = batch.option_mask.to(predictor.device)
        mu, sigma = predictor.head.gaussian(predictor.hidden(batch), mask)
        for i, q in enumerate(questions[start : start + batch_size]):
            out.append((mu[i, : q.num_options].float().cpu(), sigma[i, : q.num_options].float().cpu()))
    return out


def measure(pairs, labels, mode: str, zeta: float, samples: int) -> dict:
    probs = []
    for i, (mu, sigma) in enumerate(pairs):
        alpha = alphas(mu.unsqueeze(0), sigma.unsqueeze(0), mode, samples, seed=i)
        alpha = torch.clamp(alpha - zeta * sigma.unsqueeze(0), min=1.0)
        probs.append(dirichlet_outputs(alpha).probs[0].tolist())
    full = metrics.summarise(probs, labels)
    return {k: full[k] for k in ("accuracy", "ece", "nll", "brier", "mean_confidence")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ib_edl_inference", description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", required=True, help="a trained IB-EDL artifact with its training record")
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--output", default="benchmarks/results/ib_edl_inference.json")
    args = parser.parse_args(argv)
    from ibedl.training.experiments.evaluate_run import load_run
    from ibedl.training.finetune import run_questions

    predictor = load_run(args.artifact)
    if predictor.head.config.kind != "ib_edl":
        parser.error(f"--artifact must hold an IB-EDL adapter, got head kind {predictor.head.config.kind!r}")
    training = predictor.manifest.training or {}
    _, _, val_q = run_questions(training)
    pairs = gaussians(predictor, val_q)
    labels = [q.answer for q in val_q]
    zeta = float(predictor.head.config.zeta)
    result = {
        "artifact": args.artifact, "split": "validation", "n": len(val_q), "samples": args.samples, "zeta": zeta,
        "sigma": sigma_summary([float(s.mean()) for _, s in pairs]),
        "modes": {mode: {"zeta_0": measure(pairs, labels, mode, 0.0, args.samples),
                         "zeta_fitted": measure(pairs, labels, mode, zeta, args.samples)} for mode in MODES},
    }
    write_result(args.output, result)
    for mode, r in result["modes"].items():
        print(f"{mode:10s} " + "  ".join(f"{k} {v:.4f}" for k, v in r["zeta_fitted"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
