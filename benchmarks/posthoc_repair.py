"""Can a post-hoc step on top of zeta repair the default's calibration without giving up its gate? Chosen on
validation, judged on fresh questions no recipe drew (issue 57 item 5).

    python -m benchmarks.paired_bootstrap --reference artifacts/map-twin --artifacts artifacts/default \
        --dataset sciq --split train --limit 2000 --sample-seed 1 --unseen-by artifacts/default artifacts/map-twin \
        --output benchmarks/results/paired_bootstrap_fresh_sciq.json \
        --save-answers benchmarks/results/decision_scores/fresh_sciq_answers.json
    python -m benchmarks.posthoc_repair [--scores benchmarks/results/decision_scores/default.json]
        [--fresh benchmarks/results/decision_scores/fresh_sciq_answers.json] [--output ...posthoc_repair.json]

The step: an *evidence temperature* tau after zeta, alpha <- offset + (max(alpha - zeta * sigma, offset) - offset) /
tau. It keeps a Dirichlet (belief masses and u stay what the probabilities imply), and tau keeps u's order among
questions with the same number of options, so at a given zeta the OOD gate ranks them as before (a new zeta may
not); tau > 1 flattens, tau < 1 sharpens (up to the belief masses' proportions). Candidates, each fitted by NLL on
SciQ validation (the raw outputs of ``benchmarks.decisions score``, post-hoc step neutral; the served zeta was fitted
on the calibration's fit part of the same questions):

- ``served``: the manifest's zeta, tau 1 (what the service answers);
- ``zeta``: zeta refitted on the grid (ibedl.training.head_kinds.ZETA_GRID), tau 1;
- ``zeta+tau``: zeta and tau fitted together (ZETA_GRID x TAU_GRID).

The candidates are nested (TAU_GRID holds 1), so ``zeta+tau`` never has the higher validation NLL: the choice is
whether what it gains on the fresh sample is worth a second parameter.

Per candidate, on validation: NLL, ECE and the gate's mean AUROC of 1/u against the five shifted ``_dev`` streams
(validation splits). The candidate with the lowest validation NLL is chosen. Then, read once on the fresh sample
(the test): its ECE, NLL and accuracy against the temperature-scaled MAP twin's and the served default's, by paired
bootstrap (benchmarks.paired_bootstrap).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import write_result
from benchmarks.paired_bootstrap import PerQuestion, adapter_identity, paired_bootstrap
from ibedl.core.head import adjust_alpha
from ibedl.training import metrics
from ibedl.training.head_kinds import ZETA_GRID

TAU_GRID = tuple(float(t) for t in np.round(np.exp(np.linspace(np.log(0.25), np.log(4.0), 49)), 6))
SHIFTED_DEV = ("sciq_no_passage_dev", "obqa_dev", "arc_easy_dev", "arc_challenge_dev", "race_no_article_dev")


def repaired(alpha: np.ndarray, sigma: np.ndarray, zeta: float, tau: float, offset: float = 1.0) -> np.ndarray:
    """alpha (N, C) with the post-hoc step neutral -> offset + (max(alpha - zeta * sigma, offset) - offset) / tau."""
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau!r}")
    shifted = adjust_alpha(torch.as_tensor(alpha), torch.as_tensor(sigma), zeta, offset).numpy()  # the head's map
    return offset + (shifted - offset) / tau


def outputs(alpha: np.ndarray, offset: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(probabilities (N, C), u (N,)) of Dirichlets with concentrations ``alpha`` (N, C)."""
    total = alpha.sum(1)
    return alpha / total[:, None], alpha.shape[1] * offset / total


def nll(probs: np.ndarray, labels: np.ndarray) -> float:
    """metrics.nll on (N, C) arrays at once (the same floor): it runs per row, too slow for the fit's 4,000 points."""
    return float(-np.log(np.maximum(probs[np.arange(len(labels)), labels], 1e-12)).mean())


def fit(alpha: np.ndarray, sigma: np.ndarray, labels: np.ndarray, zetas, taus,
        offset: float = 1.0) -> tuple[float, float, float]:
    """(zeta, tau, NLL) with the lowest NLL over the grid (ties: the smallest |zeta|, then tau nearest 1)."""
    best = None
    for zeta in zetas:
        for tau in taus:
            value = round(nll(outputs(repaired(alpha, sigma, zeta, tau, offset), offset)[0], labels), 12)
            key = (value, abs(zeta), abs(np.log(tau)))
            if best is None or key < best[0]:
                best = (key, float(zeta), float(tau), value)
    return best[1], best[2], best[3]


def stream(scores: dict, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A 4-option stream's raw alpha (N, 4), sigma (N, 4) and labels (N,); questions with another count are left
    out (the gate compares u within a count)."""
    s = scores["streams"][name]
    keep = [i for i, a in enumerate(s["alpha"]) if len(a) == 4]
    return (np.asarray([s["alpha"][i] for i in keep]), np.asarray([s["sigma"][i] for i in keep]),
            np.asarray([s["labels"][i] for i in keep]))


def gate_auroc(scores: dict, zeta: float, tau: float, offset: float = 1.0) -> float:
    """Mean AUROC of 1/u, SciQ validation (positive) against each shifted validation stream, 4-option questions."""
    alpha, sigma, _ = stream(scores, "sciq_validation")
    inside = 1 / outputs(repaired(alpha, sigma, zeta, tau, offset), offset)[1]
    values = []
    for name in SHIFTED_DEV:
        a, s, _ = stream(scores, name)
        values.append(metrics.auroc(inside, 1 / outputs(repaired(a, s, zeta, tau, offset), offset)[1]))
    return float(np.mean(values))


def stale(recorded: dict | None, path: str) -> str | None:
    """Why answers recorded as made by ``recorded`` (paired_bootstrap's ``adapters`` entry) are not the adapter at
    ``path`` as it is now (its weights, served sections or the calibration they were made under), or None."""
    if recorded is None:
        return f"no record of what {path} answered with (answers saved before they recorded it)"
    try:
        now = adapter_identity(path, recorded.get("calibration_key", ""))
    except (OSError, ValueError) as e:
        return f"{path} cannot be checked ({e})"
    differ = sorted(k for k in now if recorded.get(k) != now[k])
    return f"{path} has changed since its answers ({', '.join(differ)})" if differ else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.posthoc_repair", description=__doc__.split("\n\n")[0])
    parser.add_argument("--scores", default="benchmarks/results/decision_scores/default.json",
                        help="the default's raw outputs on validation streams (python -m benchmarks.decisions score)")
    parser.add_argument("--fresh", default="benchmarks/results/decision_scores/fresh_sciq_answers.json",
                        help="both adapters' answers on the fresh sample (paired_bootstrap --save-answers)")
    parser.add_argument("--artifact", default="artifacts/default", help="the default (its served zeta)")
    parser.add_argument("--twin", default="artifacts/map-twin")
    parser.add_argument("--resamples", type=int, default=2000)
    parser.add_argument("--output", default="benchmarks/results/posthoc_repair.json")
    args = parser.parse_args(argv)
    if args.resamples < 100:
        parser.error(f"--resamples must be at least 100, got {args.resamples}")
    try:
        scores = json.loads(Path(args.scores).read_text())
        fresh = json.loads(Path(args.fresh).read_text())
        default, twin = fresh["answers"][args.artifact], fresh["answers"][args.twin]
    except (OSError, KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in (args.artifact, args.twin):  # the answers are the adapters' as they are now, or they are stale
        problem = stale(fresh.get("adapters", {}).get(path), path)
        if problem:
            print(f"error: {args.fresh}: {problem}: answer the fresh sample again (python -m "
                  "benchmarks.paired_bootstrap ... --save-answers)", file=sys.stderr)
            return 2
    # not stale: the recorded weights are the default's now (hashed once, in stale)
    if scores.get("weights_sha256") != fresh["adapters"][args.artifact]["weights_sha256"]:
        print(f"error: {args.scores} was scored on other weights than {args.artifact}'s", file=sys.stderr)
        return 2
    offset = float(scores.get("offset", 1.0))
    served = {"zeta": float(fresh["adapters"][args.artifact]["posthoc"].get("zeta", 0.0)), "tau": 1.0}

    val_alpha, val_sigma, val_labels = stream(scores, "sciq_validation")
    refit, _, _ = fit(val_alpha, val_sigma, val_labels, ZETA_GRID, (1.0,), offset)
    z, t, _ = fit(val_alpha, val_sigma, val_labels, ZETA_GRID, TAU_GRID, offset)
    candidates = {"served": served, "zeta": {"zeta": refit, "tau": 1.0}, "zeta+tau": {"zeta": z, "tau": t}}
    validation = {}
    for name, c in candidates.items():
        probs, _ = outputs(repaired(val_alpha, val_sigma, c["zeta"], c["tau"], offset), offset)
        validation[name] = {**c, "nll": nll(probs, val_labels), "ece": metrics.ece(list(probs), val_labels, 15),
                            "accuracy": metrics.accuracy(list(probs), val_labels),
                            "gate_auroc_dev": gate_auroc(scores, c["zeta"], c["tau"], offset)}
    chosen = min(validation, key=lambda n: validation[n]["nll"])

    # the fresh sample: the default's served alpha back to the raw, zeta undone (alpha + zeta * sigma). A negative zeta
    # only raises alpha, so nothing reached the floor; with a positive one an entry at the floor cannot be undone.
    labels = np.asarray(fresh["labels"])
    alpha = [np.asarray(a) for a in default["alpha"]]
    sigma = [np.asarray(s) for s in default["sigma"]]
    if served["zeta"] > 0 and any(((a <= offset + 1e-6) & (s > 0)).any() for a, s in zip(alpha, sigma, strict=True)):
        print("error: the served alpha was clipped at the floor: zeta cannot be undone", file=sys.stderr)
        return 2
    raw = [a + served["zeta"] * s for a, s in zip(alpha, sigma, strict=True)]
    gap = max(float(np.abs(np.asarray(p) - a / a.sum()).max()) for p, a in zip(default["probs"], alpha, strict=True))

    def answered(c: dict) -> PerQuestion:
        probs = [outputs(repaired(r[None, :], s[None, :], c["zeta"], c["tau"], offset), offset)[0][0]
                 for r, s in zip(raw, sigma, strict=True)]
        return PerQuestion.from_probs(probs, labels)

    twin_q = PerQuestion.from_probs([np.asarray(p) for p in twin["probs"]], labels)
    answers = {name: answered(c) for name, c in candidates.items()}
    comparisons = {f"{name} minus the twin": paired_bootstrap(twin_q, q, args.resamples) for name, q in answers.items()}
    comparisons |= {f"{name} minus served": paired_bootstrap(answers["served"], q, args.resamples)
                    for name, q in answers.items() if name != "served"}
    write_result(args.output, {
        "command": "python -m benchmarks.posthoc_repair " + " ".join(argv if argv is not None else sys.argv[1:]),
        "fresh_sample": {"n": len(labels), "answers": args.fresh,
                         "drawn_by": "benchmarks/results/paired_bootstrap_fresh_sciq.json (its command)"},
        "served_probs_match_alpha": gap,
        "validation": {"stream": "sciq_validation (4-option questions)", "n": len(val_labels),
                       "gate": "mean AUROC of 1/u against " + ", ".join(SHIFTED_DEV), "candidates": validation,
                       "chosen": chosen, "criterion": "validation NLL"},
        "fresh": {"differences": "candidate minus reference; ci95 over paired resamples of the fresh questions",
                  "comparisons": comparisons},
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
