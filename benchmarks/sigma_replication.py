"""Does IB-EDL's sigma add to 1/u where the sigma search hinted it might? The replication (issue 57 item 4), its
test fixed before its runs existed.

    nice -n 19 python -m ibedl.training.experiments.benchmark --config benchmarks/sciq_sigma_replication.yaml
    python -m benchmarks.sigma_replication [--runs runs/benchmark/sciq_sigma_replication]
                                           [--output benchmarks/results/sigma_replication.json]

The runs: the search's candidate 2 (sigma rows started at zero, sigma's learning rate 20x the head's), unchanged,
on seeds 1, 2 and 3 (the hint was found on seed 0). For each run, at zeta 0, per question 1/u and mean sigma on
the validation streams (SciQ validation, the five shifted streams from validation splits, 300 each) and on the test
streams (SciQ test, the five shifted streams from test splits, 500 each; SciQ without passages is SciQ test bare).

Fitted on validation data only, then frozen, per run:

- **shift**: one logistic model of (log 1/u, log sigma), SciQ validation against the five shifted validation
  streams pooled (classes balanced): one gate for every shift, as a service would deploy it;
- **right**: one logistic model of the same, right against wrong answers on SciQ validation.

Read once on the test streams: per shifted stream, the AUROC of the shift model's score minus that of 1/u alone
(SciQ test the positive class), and on SciQ test the right model's AUROC for right against wrong minus 1/u's:
six comparisons. Intervals come from one set of bootstrap resamples of the test questions (classes resampled
apart for a shift; questions for right against wrong), shared by the seeds, so the pooled gain (the mean over
seeds) has its own interval; the level is Bonferroni's for the six (each interval 1 - 0.05/6, the family 95%),
per seed and pooled, with the uncorrected 95% interval beside it. Sigma adds in a comparison when the pooled
corrected interval lies above 0 (``holds``) and takes away when it lies below (``against``); ``seeds_above``
counts the seeds whose own corrected interval lies above 0. Per-question scores are kept in
``benchmarks/results/sigma_search_scores/replication-s<seed>.json``, so the report is recomputed without a model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr
from sklearn.linear_model import LogisticRegression

from benchmarks.common import write_result
from benchmarks.decisions import SHIFTED, streams
from benchmarks.sigma_information import pair
from benchmarks.sigma_search import fast_auroc, partial_spearman_ci, run_features

RUNS = Path("runs/benchmark/sciq_sigma_replication")
OUTPUT = Path("benchmarks/results/sigma_replication.json")
SCORES = Path("benchmarks/results/sigma_search_scores")
SEEDS = (1, 2, 3)
TEST_LIMIT = 500  # questions per shifted test stream
RESAMPLES = 4000  # enough for the 0.4% tails of a Bonferroni interval over six comparisons
FAMILY_ALPHA = 0.05
COMPARISONS = (*SHIFTED, "right_vs_wrong")


def fit_frozen(val: dict, dev: list[dict]) -> dict:
    """The two combining models of one run, fitted on its validation streams only: ``shift`` (SciQ validation
    against the shifted validation streams pooled) and ``right`` (right against wrong on SciQ validation). Each
    stream: {"inv_u": (n,), "sigma": (n,), "right": (n,)}. Returns {name: (2,) weights of (log 1/u, log sigma)}:
    the score is their dot product (a logistic model's intercept does not move an AUROC)."""
    x = np.concatenate([pair(val), *(pair(d) for d in dev)])
    y = np.concatenate([np.ones(len(val["inv_u"])), *(np.zeros(len(d["inv_u"])) for d in dev)])
    shift = LogisticRegression(class_weight="balanced").fit(x, y)
    right = LogisticRegression(class_weight="balanced").fit(pair(val), np.asarray(val["right"]))
    return {"shift": shift.coef_[0].copy(), "right": right.coef_[0].copy()}


def comparison_items(test: dict, weights: dict, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One comparison on one run's test streams: (labels, frozen combined score, log 1/u, strata) over its items.
    Strata: the class for a shift (positives and negatives resampled apart), one stratum for right against wrong."""
    ind = test["sciq_test"]
    if name == "right_vs_wrong":
        x, y = pair(ind), np.asarray(ind["right"], dtype=float)
        return y, x @ weights["right"], x[:, 0], np.zeros(len(y), dtype=int)
    shifted = test[name]
    x = np.concatenate([pair(ind), pair(shifted)])
    y = np.r_[np.ones(len(ind["inv_u"])), np.zeros(len(shifted["inv_u"]))]
    return y, x @ weights["shift"], x[:, 0], (1 - y).astype(int)


def resample(strata: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Indices drawn with replacement within each stratum, as many as it holds."""
    return np.concatenate([rng.choice(idx, len(idx)) for idx in (np.flatnonzero(strata == s)
                                                                 for s in np.unique(strata))])


def interval(draws: np.ndarray, alpha: float) -> list[float]:
    low, high = np.percentile(draws, [100 * alpha / 2, 100 * (1 - alpha / 2)])
    return [float(low), float(high)]


def frozen_gains(runs: dict, resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """Every comparison's gain per run and pooled (the mean over runs), with corrected and 95% intervals.
    ``runs``: {seed: {"weights": fit_frozen(...), "test": {stream: features}}}; every run's test streams must hold
    the same questions (they do: the streams are drawn with a fixed seed), so one resample serves every run."""
    corrected = FAMILY_ALPHA / len(COMPARISONS)
    rng = np.random.default_rng(seed)
    out = {}
    for name in COMPARISONS:
        items = {s: comparison_items(r["test"], r["weights"], name) for s, r in runs.items()}
        strata = next(iter(items.values()))[3]
        if any(len(i[3]) != len(strata) for i in items.values()):
            raise ValueError(f"{name}: the runs' test streams differ in length; they must hold the same questions")
        draws = {s: [] for s in items}
        for _ in range(resamples):
            i = resample(strata, rng)
            for s, (y, combined, inv_u, _) in items.items():
                yi = y[i]
                draws[s].append(np.nan if yi.min() == yi.max() else
                                fast_auroc(yi, combined[i]) - fast_auroc(yi, inv_u[i]))
        per_seed = {}
        for s, (y, combined, inv_u, _) in items.items():
            d = np.asarray(draws[s])
            d = d[~np.isnan(d)]
            g = fast_auroc(y, combined) - fast_auroc(y, inv_u)
            per_seed[str(s)] = {"auroc_inv_u": fast_auroc(y, inv_u), "auroc_combined": fast_auroc(y, combined),
                                "gain": g, "ci_corrected": interval(d, corrected), "ci95": interval(d, 0.05),
                                "positives": int(y.sum()), "negatives": int(len(y) - y.sum())}
        pooled_draws = np.nanmean(np.asarray([draws[s] for s in items]), axis=0)
        pooled_draws = pooled_draws[~np.isnan(pooled_draws)]
        ci = interval(pooled_draws, corrected)
        out[name] = {"per_seed": per_seed,
                     "pooled": {"gain": float(np.mean([p["gain"] for p in per_seed.values()])),
                                "auroc_inv_u": float(np.mean([p["auroc_inv_u"] for p in per_seed.values()])),
                                "ci_corrected": ci, "ci95": interval(pooled_draws, 0.05),
                                "holds": ci[0] > 0, "against": ci[1] < 0},
                     "seeds_above": sum(p["ci_corrected"][0] > 0 for p in per_seed.values()),
                     "seeds_below": sum(p["ci_corrected"][1] < 0 for p in per_seed.values())}
    return out


def describe(feats: dict) -> dict:
    """Sigma against 1/u on one run's streams: Spearman per stream, and sigma's partial Spearman with being right
    given 1/u on SciQ validation and SciQ test (the statistic of the search's hint, 0.20 there)."""
    return {"spearman_sigma_inv_u": {n: float(spearmanr(f["sigma"], f["inv_u"]).statistic) for n, f in feats.items()},
            "partial_spearman_sigma_right_given_inv_u": {
                n: partial_spearman_ci(feats[n]["sigma"], np.asarray(feats[n]["right"], float), feats[n]["inv_u"])
                for n in ("sciq_validation", "sciq_test")},
            "sigma_median": {n: float(np.median(f["sigma"])) for n, f in feats.items()}}


def run_scores(run: Path, seed: int, scores: Path, questions, batch_size: int) -> dict:
    """A run's per-question features on every stream, from its scores file, else through its model (then kept)."""
    path = scores / f"replication-s{seed}.json"
    if path.is_file():
        stored = json.loads(path.read_text())
    else:
        if not (run / "manifest.json").is_file():
            raise FileNotFoundError(f"{run} is not on this machine: train it with python -m ibedl.training."
                                    "experiments.benchmark --config benchmarks/sciq_sigma_replication.yaml")
        stored = {"run": str(run), "seed": seed, "zeta": 0, **run_features(str(run), questions(), batch_size)}
        stored.pop("hits", None)  # each stream carries its own right answers
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(stored) + "\n")
    return {name: {k: np.asarray(v) for k, v in f.items()} for name, f in stored["streams"].items()}


def report(feats_by_seed: dict, resamples: int = RESAMPLES) -> dict:
    """The replication's result from each seed's per-question features (``run_scores``)."""
    runs, described, weights = {}, {}, {}
    for seed, feats in feats_by_seed.items():
        w = fit_frozen(feats["sciq_validation"], [feats[f"{s}_dev"] for s in SHIFTED])
        runs[seed] = {"weights": w, "test": {n: feats[n] for n in ("sciq_test", *SHIFTED)}}
        weights[str(seed)] = {k: {"log_inv_u": float(v[0]), "log_sigma": float(v[1])} for k, v in w.items()}
        described[str(seed)] = describe(feats)
    gains = frozen_gains(runs, resamples)
    return {"seeds": [int(s) for s in feats_by_seed], "zeta": 0, "resamples": resamples,
            "family": list(COMPARISONS), "level_corrected": 1 - FAMILY_ALPHA / len(COMPARISONS),
            "questions": {n: int(len(f["inv_u"])) for n, f in next(iter(feats_by_seed.values())).items()},
            "frozen_weights": weights, "comparisons": gains, "sigma": described,
            "replicated": [n for n, g in gains.items() if g["pooled"]["holds"]],
            "against": [n for n, g in gains.items() if g["pooled"]["against"]]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sigma_replication",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default=str(RUNS), help="the trained runs (sciq-ib_edl-s<seed> under it)")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--output", default=str(OUTPUT))
    parser.add_argument("--scores", default=str(SCORES),
                        help="per-seed 1/u, sigma and right answers (read, or written)")
    parser.add_argument("--resamples", type=int, default=RESAMPLES)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args(argv)
    if args.resamples < 100:
        parser.error(f"--resamples must be at least 100, got {args.resamples}")
    loaded = {}

    def questions() -> dict:  # validation and test streams, loaded only when a run must go through its model
        if not loaded:
            loaded.update(streams(TEST_LIMIT))
        return loaded

    try:
        feats = {s: run_scores(Path(args.runs) / f"sciq-ib_edl-s{s}", s, Path(args.scores), questions,
                               args.batch_size) for s in args.seeds}
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = {"command": "python -m benchmarks.sigma_replication " + " ".join(argv if argv is not None
                                                                                else sys.argv[1:]),
              "config": "benchmarks/sciq_sigma_replication.yaml", **report(feats, args.resamples)}
    write_result(args.output, result, echo=False)
    print(json.dumps({n: {k: g["pooled"][k] for k in ("gain", "ci_corrected")} | {"seeds_above": g["seeds_above"]}
                      for n, g in result["comparisons"].items()}, indent=1))
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
