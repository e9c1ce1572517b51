"""How Laplace-LoRA's prior precision is chosen, on validation data only: the GLM predictive's NLL, ECE and mean
confidence at every value of the prior-precision grid, at the marginal likelihood's value, and MAP's softmax.

    python -m benchmarks.laplace_prior [--run DIR ...] [--fit-samples 100]
        [--output benchmarks/results/laplace_prior.json]

Each ``--run`` is a trained MAP run (default: the SciQ grid's, which ``python -m ibedl.training.experiments.benchmark
--config benchmarks/sciq_grid.yaml`` writes under ``runs/benchmark/sciq_grid``). The KFAC posterior is fitted as the
grid's Laplace cells fit it (``fit_samples`` of the run's own training draw, its labels as trained) and evaluated
on the run's validation questions; the test split is not read.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from benchmarks.common import write_result

GRID_RUNS = "runs/benchmark/sciq_grid"
DEFAULT_RUNS = ([f"{GRID_RUNS}/sciq-map-s{s}" for s in (0, 1, 2)]
                + [f"{GRID_RUNS}/sciq-noise0.3-map-s{s}" for s in (0, 1)])
KEPT = ("accuracy", "nll", "ece", "mean_confidence")  # the metrics kept per prior precision


def measure(run: Path, fit_samples: int) -> dict:
    """One run: the validation metrics of MAP, of the marginal likelihood's prior and of every grid value."""
    from ibedl.training import metrics
    from ibedl.training.experiments.evaluate_run import load_run
    from ibedl.training.finetune import predictive_fit_questions, run_questions
    from ibedl.training.laplace_lora import PRIOR_GRID, fit_laplace, grid_edge, predictives_over_grid
    from ibedl.training.methods import get_method

    predictor = load_run(run)
    training = predictor.manifest.training or {}
    cfg, train_q, val_q = run_questions(training)
    laplace_method = get_method("laplace")
    fit_q = predictive_fit_questions(laplace_method, laplace_method.params({"fit_samples": fit_samples}), train_q,
                                     cfg.seed)
    laplace = fit_laplace(predictor, fit_q, prior_precision="marglik")
    marglik = laplace.prior_info["prior_precision"]
    values = (*PRIOR_GRID, marglik)
    over_grid, map_probs = predictives_over_grid(laplace, val_q, values, progress=True)
    labels = [q.answer for q in val_q]
    kept = lambda probs: {k: v for k, v in metrics.summarise(probs, labels).items() if k in KEPT}  # noqa: E731
    grid = [{"prior_precision": v, **kept(p)} for v, p in zip(PRIOR_GRID, over_grid[: len(PRIOR_GRID)], strict=True)]
    best = min(range(len(grid)), key=lambda i: grid[i]["nll"])
    return {"run": str(run), "seed": cfg.seed, "label_noise": cfg.data.label_noise, "fit_questions": len(fit_q),
            "validation_questions": len(val_q), "map": kept(map_probs),
            "marglik": {"prior_precision": marglik, **kept(over_grid[-1])},
            "validation_choice": {**grid[best], "at_grid_edge": grid_edge(PRIOR_GRID, PRIOR_GRID[best])},
            "grid": grid}


def table(runs: list[dict]) -> str:
    lines = [f"{'run':<22} {'predictive':<24} {'NLL':>6} {'ECE %':>6} {'conf':>5} {'acc %':>6}"]
    for r in runs:
        for name, m in (("MAP", r["map"]), (f"marglik {r['marglik']['prior_precision']:.3g}", r["marglik"]),
                        (f"validation {r['validation_choice']['prior_precision']:.3g}", r["validation_choice"])):
            lines.append(f"{Path(r['run']).name:<22} {name:<24} {m['nll']:6.3f} {100 * m['ece']:6.1f} "
                         f"{m['mean_confidence']:5.3f} {100 * m['accuracy']:6.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.laplace_prior", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="append",
                        help=f"a trained MAP run (repeatable; default: the SciQ grid's MAP runs under "
                        f"{GRID_RUNS}, seeds 0-2 and the two with label noise)")
    parser.add_argument("--fit-samples", type=int, default=100, help="training questions the posterior is fitted on "
                        "(default 100, the grid's)")
    parser.add_argument("--output", default="benchmarks/results/laplace_prior.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    runs = [Path(r) for r in (args.run or DEFAULT_RUNS)]
    missing = [str(r) for r in runs if not (r / "manifest.json").is_file()]
    if missing:
        print(f"error: no trained run at {', '.join(missing)} (the SciQ grid writes them: python -m "
              "ibedl.training.experiments.benchmark --config benchmarks/sciq_grid.yaml)", file=sys.stderr)
        return 2
    if args.fit_samples < 1:
        print(f"error: --fit-samples must be >= 1, got {args.fit_samples}", file=sys.stderr)
        return 2
    measured = [measure(run, args.fit_samples) for run in runs]
    write_result(args.output, {
        "command": "python -m benchmarks.laplace_prior " + " ".join(argv if argv is not None else sys.argv[1:]),
        "note": "validation questions only; the GLM probit predictive at each prior precision of the grid the "
                "Laplace method chooses from, at the marginal likelihood's value, and MAP's softmax",
        "runs": measured,
    }, echo=False)
    print(table(measured))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
