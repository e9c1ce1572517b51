"""Does IB-EDL's sigma add to 1/u where the sigma search hinted it might? The replication (issue 57 item 4), its
test fixed before its runs existed.

    nice -n 19 python -m ibedl.training.experiments.benchmark --config benchmarks/sciq_sigma_replication.yaml
    python -m benchmarks.sigma_replication [--runs runs/benchmark/sciq_sigma_replication]
                                           [--output benchmarks/results/sigma_replication.json]

The runs: the search's candidate 2 (sigma rows started at zero, sigma's learning rate 20x the head's), unchanged,
on seeds 1, 2 and 3 (the family; the hint was found on seed 0, trained again as an anchor outside the family). For
each run, at zeta 0, per question 1/u and mean sigma on the validation streams (SciQ validation, the five shifted
streams from validation splits, 300 each) and on the test streams (SciQ test; SciQ test without its passages; 500
questions each of OBQA, ARC-Easy, ARC-Challenge and RACE without its articles, from their test splits).

Fitted on validation data only, then frozen, per run:

- **shift**: one logistic model of (log 1/u, log sigma), SciQ validation against the five shifted validation
  streams pooled (classes balanced): one gate for every shift, as a service would deploy it (the hint fitted one
  per stream, on that stream's own labels);
- **right**: one logistic model of the same, right against wrong answers on SciQ validation.

Read once on the test streams, seven comparisons: per shifted stream, the AUROC of the shift model's score minus
that of 1/u alone (SciQ test the positive class); on SciQ test the right model's AUROC for right against wrong
minus 1/u's; and sigma's partial Spearman correlation with being right given 1/u on SciQ test (the hint's own
statistic, 0.20 on validation; no model). Intervals come from one set of bootstrap resamples of the test questions
shared by the seeds, so the pooled value (the mean over seeds) has its own: a shift resamples SciQ test and the
shifted stream apart, except SciQ without passages, whose questions are SciQ test's own and are resampled in
pairs; the in-distribution comparisons resample SciQ test's questions. The level is Bonferroni's for the seven
(each interval 1 - 0.05/7, the family 95%), per seed and pooled, with the uncorrected 95% interval beside it.

The decision, fixed before the runs: sigma adds in a comparison (``replicated``) when the pooled corrected
interval lies above 0 and at least two of the three seeds' own corrected intervals do too; ``pooled_only`` when
the pooled interval alone does; ``against`` when the pooled interval lies below 0. The intervals carry the test
questions' sampling error for these three trained runs, not the spread of a new seed. Per-question scores, with
the weights and the questions they were made on, are kept in ``benchmarks/results/sigma_search_scores/
replication-s<seed>.json``, so the report is recomputed without a model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr
from sklearn.linear_model import LogisticRegression

from benchmarks.common import write_result
from benchmarks.decisions import SHIFTED, streams
from benchmarks.sigma_information import pair
from benchmarks.sigma_search import fast_auroc, partial_spearman, partial_spearman_ci, run_features

RUNS = Path("runs/benchmark/sciq_sigma_replication")
OUTPUT = Path("benchmarks/results/sigma_replication.json")
SCORES = Path("benchmarks/results/sigma_search_scores")
GRID_RESULTS = Path("benchmarks/results/sciq_sigma_replication.json")  # the runner's: each run's training record
SEARCH = Path("benchmarks/results/sciq_sigma_search.json")
SEEDS = (1, 2, 3)  # the family; seed 0 is the anchor
ANCHOR_SEED, HINT_CANDIDATE = 0, 2
TEST_LIMIT = 500  # questions per shifted test stream drawn from a test split
RESAMPLES = 10000  # about 36 draws in each 0.36% tail of a corrected interval
MIN_RESAMPLES = 2000
FAMILY_ALPHA = 0.05
PAIRED = "sciq_no_passage"  # SciQ test's own questions without their passages
COMPARISONS = (*SHIFTED, "right_vs_wrong", "partial_spearman_right")


@dataclass
class Comparison:
    """One comparison on one run's test streams. ``blocks``: per stratum, an (units, items per unit) array of item
    indices drawn together; ``statistic(i)``: the comparison's value on the items ``i`` (all items: its value)."""

    blocks: list[np.ndarray]
    statistic: Callable[[np.ndarray], float]
    extra: dict

    def everything(self) -> np.ndarray:
        return np.concatenate([b.ravel() for b in self.blocks])


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


def auroc_gain(y: np.ndarray, combined: np.ndarray, inv_u: np.ndarray) -> Callable[[np.ndarray], float]:
    def statistic(i: np.ndarray) -> float:
        yi = y[i]
        return np.nan if yi.min() == yi.max() else fast_auroc(yi, combined[i]) - fast_auroc(yi, inv_u[i])
    return statistic


def comparison(test: dict, weights: dict, name: str) -> Comparison:
    """Comparison ``name`` (one of COMPARISONS) on one run's test stream features, with its frozen weights."""
    ind = test["sciq_test"]
    n = len(ind["inv_u"])
    single = np.arange(n)[:, None]
    if name == "partial_spearman_right":
        sigma, right, inv_u = ind["sigma"], np.asarray(ind["right"], float), ind["inv_u"]
        return Comparison([single], lambda i: partial_spearman(sigma[i], right[i], inv_u[i]), {})
    if name == "right_vs_wrong":
        x, y = pair(ind), np.asarray(ind["right"], float)
        return Comparison([single], auroc_gain(y, x @ weights["right"], x[:, 0]),
                          {"positives": int(y.sum()), "negatives": int(n - y.sum()),
                           "auroc_inv_u": fast_auroc(y, x[:, 0])})
    shifted = test[name]
    x = np.concatenate([pair(ind), pair(shifted)])
    y = np.r_[np.ones(n), np.zeros(len(shifted["inv_u"]))]
    if name == PAIRED:  # the same questions with and without their passages: drawn in pairs
        if len(shifted["inv_u"]) != n:
            raise ValueError(f"{PAIRED} must hold SciQ test's {n} questions, got {len(shifted['inv_u'])}")
        blocks = [np.c_[np.arange(n), n + np.arange(n)]]
    else:
        blocks = [single, n + np.arange(len(shifted["inv_u"]))[:, None]]
    return Comparison(blocks, auroc_gain(y, x @ weights["shift"], x[:, 0]),
                      {"positives": n, "negatives": int(len(y) - n), "auroc_inv_u": fast_auroc(y, x[:, 0])})


def resample(blocks: list[np.ndarray], rng: np.random.Generator) -> np.ndarray:
    """Item indices: in each stratum, as many units as it holds drawn with replacement, each unit's items together."""
    return np.concatenate([b[rng.integers(0, len(b), len(b))].ravel() for b in blocks])


def interval(draws: np.ndarray, alpha: float) -> list[float]:
    low, high = np.percentile(draws, [100 * alpha / 2, 100 * (1 - alpha / 2)])
    return [float(low), float(high)]


def frozen_gains(runs: dict, resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """Every comparison per run and pooled (the mean over runs), with corrected and 95% intervals. ``runs``:
    {seed: {"weights": fit_frozen(...), "test": {stream: features}}}. The runs' test streams must hold the same
    questions (``same_questions``), so one resample serves every run."""
    corrected = FAMILY_ALPHA / len(COMPARISONS)
    rng = np.random.default_rng(seed)
    out = {}
    for name in COMPARISONS:
        comps = {s: comparison(r["test"], r["weights"], name) for s, r in runs.items()}
        blocks = next(iter(comps.values())).blocks
        if any(len(c.blocks) != len(blocks) or any(a.shape != b.shape for a, b in zip(c.blocks, blocks, strict=True))
               for c in comps.values()):
            raise ValueError(f"{name}: the runs' test streams differ in size; they must hold the same questions")
        draws = np.full((len(comps), resamples), np.nan)
        for k in range(resamples):
            i = resample(blocks, rng)
            for j, c in enumerate(comps.values()):
                draws[j, k] = c.statistic(i)
        per_seed = {}
        for j, (s, c) in enumerate(comps.items()):
            d = draws[j][~np.isnan(draws[j])]
            per_seed[str(s)] = {"value": float(c.statistic(c.everything())), "ci_corrected": interval(d, corrected),
                                "ci95": interval(d, 0.05), **c.extra}
        pooled = np.nanmean(draws, axis=0)
        pooled = pooled[~np.isnan(pooled)]
        ci = interval(pooled, corrected)
        above = sum(p["ci_corrected"][0] > 0 for p in per_seed.values())
        out[name] = {"per_seed": per_seed,
                     "pooled": {"value": float(np.mean([p["value"] for p in per_seed.values()])),
                                "ci_corrected": ci, "ci95": interval(pooled, 0.05)},
                     "seeds_above": above, "seeds_below": sum(p["ci_corrected"][1] < 0 for p in per_seed.values()),
                     "replicated": ci[0] > 0 and above >= 2, "pooled_only": ci[0] > 0 and above < 2,
                     "against": ci[1] < 0}
    return out


def describe(feats: dict) -> dict:
    """Sigma against 1/u on one run's streams: Spearman per stream, sigma's median, and its partial Spearman with
    being right given 1/u on SciQ validation (the hint's statistic, 95% interval)."""
    val = feats["sciq_validation"]
    return {"spearman_sigma_inv_u": {n: float(spearmanr(f["sigma"], f["inv_u"]).statistic) for n, f in feats.items()},
            "sigma_median": {n: float(np.median(f["sigma"])) for n, f in feats.items()},
            "validation_partial_spearman_sigma_right_given_inv_u":
                partial_spearman_ci(val["sigma"], np.asarray(val["right"], float), val["inv_u"])}


def questions_sha256(questions) -> str:
    """sha256 of a stream's question ids in their order (the order the features are in)."""
    return hashlib.sha256("\n".join(q.id for q in questions).encode()).hexdigest()


def run_scores(run: Path, seed: int, scores: Path, questions, batch_size: int) -> dict:
    """A run's scores file: per-question features on every stream, from the file when it was made on the run's
    weights (or the run is not on this machine), else through the run's model (then written)."""
    from ibedl.core.artifact import read_manifest
    from ibedl.training.calibrate import weights_sha256

    path = scores / f"replication-s{seed}.json"
    present = (run / "manifest.json").is_file()
    weights = weights_sha256(run, read_manifest(run)) if present else None
    if path.is_file():
        try:
            stored = json.loads(path.read_text())
        except ValueError as e:
            raise ValueError(f"{path} is not valid JSON ({e}): delete it to score the run again") from e
        if weights is None or stored.get("weights_sha256") == weights:
            return stored
        print(f"{path} was made on other weights than {run}'s: scoring the run again", file=sys.stderr)
    if not present:
        raise FileNotFoundError(f"{run} is not on this machine: train it with python -m ibedl.training."
                                "experiments.benchmark --config benchmarks/sciq_sigma_replication.yaml")
    qs = questions()
    stored = {"run": str(run), "seed": seed, "zeta": 0, "weights_sha256": weights,
              **run_features(str(run), qs, batch_size)}
    for name, f in stored["streams"].items():
        f["questions_sha256"] = questions_sha256(qs[name])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stored) + "\n")
    return stored


def same_questions(stored: dict) -> None:
    """Refuse scores files that lack a stream the test reads, or whose streams hold different questions (ids, in
    order) from seed to seed."""
    wanted = {"sciq_validation", "sciq_test", *SHIFTED, *(f"{s}_dev" for s in SHIFTED)}
    for seed, s in stored.items():
        missing = sorted(wanted - set(s.get("streams", {})))
        if missing:
            raise ValueError(f"seed {seed}'s scores lack the streams {missing}: delete its file to score it again")
    first = next(iter(stored.values()))["streams"]
    for seed, s in stored.items():
        for name, f in s["streams"].items():
            if f.get("questions_sha256") != first[name].get("questions_sha256"):
                raise ValueError(f"seed {seed}'s {name} holds other questions than seed "
                                 f"{next(iter(stored))}'s: score every run on the same streams")


def anchor(grid_results: Path, search: Path) -> dict:
    """The anchor run (seed 0, trained again) against the hint's run: validation NLL at the end and best step, from
    the runner's results and the search's."""
    try:
        records = json.loads(grid_results.read_text())
        ours = next(r["training"] for r in records if r["seed"] == ANCHOR_SEED and r["method"] == "ib_edl")
        hint = json.loads(search.read_text())["candidates"][HINT_CANDIDATE]
    except (OSError, ValueError, KeyError, IndexError, StopIteration) as e:
        return {"status": f"not available ({type(e).__name__}: {e})"}
    return {"seed": ANCHOR_SEED, "validation_end_nll": ours["validation_end"]["nll"],
            "best_step": ours["best_steps"][0], "hint_validation_end_nll": hint["validation_end"]["nll"],
            "hint_best_step": hint["best_step"], "hint_run": hint["run"],
            "nll_difference": ours["validation_end"]["nll"] - hint["validation_end"]["nll"],
            "same_best_step": ours["best_steps"][0] == hint["best_step"]}


def report(stored_by_seed: dict, resamples: int = RESAMPLES) -> dict:
    """The replication's result from each seed's scores file (``run_scores``)."""
    same_questions(stored_by_seed)
    runs, described, weights = {}, {}, {}
    for seed, stored in stored_by_seed.items():
        feats = {n: {k: np.asarray(v) for k, v in f.items() if k != "questions_sha256"}
                 for n, f in stored["streams"].items()}
        w = fit_frozen(feats["sciq_validation"], [feats[f"{s}_dev"] for s in SHIFTED])
        runs[seed] = {"weights": w, "test": {n: feats[n] for n in ("sciq_test", *SHIFTED)}}
        weights[str(seed)] = {k: {"log_inv_u": float(v[0]), "log_sigma": float(v[1])} for k, v in w.items()}
        described[str(seed)] = describe(feats)
    gains = frozen_gains(runs, resamples)
    first = next(iter(stored_by_seed.values()))["streams"]
    return {"seeds": [int(s) for s in stored_by_seed], "zeta": 0, "resamples": resamples,
            "family": list(COMPARISONS), "level_corrected": 1 - FAMILY_ALPHA / len(COMPARISONS),
            "decision": "replicated: the pooled corrected interval above 0 and at least 2 seeds' own; pooled_only: "
                        "the pooled one alone; against: the pooled one below 0",
            "questions": {n: len(f["inv_u"]) for n, f in first.items()},
            "runs": {str(s): {k: stored.get(k) for k in ("run", "weights_sha256")}
                     for s, stored in stored_by_seed.items()},
            "frozen_weights": weights, "comparisons": gains, "sigma": described,
            "replicated": [n for n, g in gains.items() if g["replicated"]],
            "pooled_only": [n for n, g in gains.items() if g["pooled_only"]],
            "against": [n for n, g in gains.items() if g["against"]]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sigma_replication",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default=str(RUNS), help="the trained runs (sciq-ib_edl-s<seed> under it)")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS),
                        help="the family's seeds (default 1 2 3; the default output takes only those)")
    parser.add_argument("--output", default=str(OUTPUT))
    parser.add_argument("--scores", default=str(SCORES),
                        help="per-seed 1/u, sigma and right answers (read, or written)")
    parser.add_argument("--grid-results", default=str(GRID_RESULTS),
                        help="the runner's results for the runs (the anchor's training record)")
    parser.add_argument("--search", default=str(SEARCH), help="the sigma search's results (the hint's run)")
    parser.add_argument("--resamples", type=int, default=RESAMPLES)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args(argv)
    if args.resamples < MIN_RESAMPLES:
        parser.error(f"--resamples must be at least {MIN_RESAMPLES}, got {args.resamples}")
    if Path(args.output) == OUTPUT and sorted(args.seeds) != list(SEEDS):
        parser.error(f"the test is read once, on the whole family: {OUTPUT} takes seeds {list(SEEDS)}, got "
                     f"{args.seeds} (write elsewhere with --output)")
    loaded = {}

    def questions() -> dict:  # validation and test streams, loaded only when a run must go through its model
        if not loaded:
            loaded.update(streams(TEST_LIMIT))
        return loaded

    try:
        stored = {s: run_scores(Path(args.runs) / f"sciq-ib_edl-s{s}", s, Path(args.scores), questions,
                                args.batch_size) for s in args.seeds}
        result = {"command": "python -m benchmarks.sigma_replication " + " ".join(argv if argv is not None
                                                                                    else sys.argv[1:]),
                  "config": "benchmarks/sciq_sigma_replication.yaml", **report(stored, args.resamples),
                  "anchor": anchor(Path(args.grid_results), Path(args.search))}
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_result(args.output, result, echo=False)
    print(json.dumps({n: {"pooled": g["pooled"]["value"], "ci_corrected": g["pooled"]["ci_corrected"],
                          "seeds_above": g["seeds_above"]} for n, g in result["comparisons"].items()}, indent=1))
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
