"""Does IB-EDL's sigma say anything 1/u does not, in any setting of the search? Scored on validation data only:

    nice -n 19 python -m benchmarks.hparam_search --config benchmarks/sciq_sigma_search.yaml   (trains the runs)
    python -m benchmarks.sigma_search [--search benchmarks/results/sciq_sigma_search.json]
                                      [--output benchmarks/results/sciq_sigma_information.json]

For every candidate run of the search, its raw outputs at zeta 0 (IB-EDL as the paper serves it, so that 1/u holds
the evidence alone) on all SciQ validation questions and on the five shifted streams drawn from validation splits
(``benchmarks.decisions``: ``<shifted>_dev``, 300 questions each). Per question sigma is its mean over the options
and 1/u = alpha0 / C. Reported per candidate:

- sigma's spread (median, coefficient of variation) and its Spearman correlation with 1/u on each stream;
- **out of distribution**, per shifted stream (SciQ validation the positive class): the AUROC of 1/u and of sigma
  (higher sigma read as in distribution), and of a logistic model of (log 1/u, log sigma) against one of log 1/u
  alone, both scored out of fold (5 folds, stratified): the **gain** of adding sigma, with a 95% interval over
  1,000 paired bootstrap resamples of the questions;
- **in distribution**, the same gain for telling right answers from wrong ones on SciQ validation, and sigma's
  partial Spearman correlation with being right once 1/u is accounted for (ranks residualised on 1/u's rank).

Sigma adds information in a setting when a gain's interval lies above zero. The test split is never read. Each
candidate's per-question 1/u and sigma are kept in ``benchmarks/results/sigma_search_scores/<run>.json``, so the
report is recomputed from them without the model (a candidate is run through the model only when its file is
missing or was made with other overrides).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedKFold

from benchmarks.common import write_result
from benchmarks.decisions import SHIFTED, streams
from benchmarks.sigma_information import auroc, features, pair

SEARCH = Path("benchmarks/results/sciq_sigma_search.json")
OUTPUT = Path("benchmarks/results/sciq_sigma_information.json")
SCORES = Path("benchmarks/results/sigma_search_scores")
FOLDS = 5
RESAMPLES = 1000


def out_of_fold(x: np.ndarray, y: np.ndarray, seed: int = 0) -> np.ndarray:
    """(n, k) features, (n,) 0/1 labels -> (n,) logistic scores, each from a model fitted on the other folds."""
    scores = np.empty(len(y))
    for fit, held in StratifiedKFold(FOLDS, shuffle=True, random_state=seed).split(x, y):
        model = LogisticRegression(class_weight="balanced").fit(x[fit], y[fit])
        scores[held] = model.decision_function(x[held])
    return scores


def average_ranks(x: np.ndarray) -> np.ndarray:
    """(n,) values -> (n,) ranks from 1, tied values sharing their mean rank: scipy.stats.rankdata's default, exactly
    (its array-API checks cost more than the sort on the bootstraps' thousands of calls; 2x faster at n = 500)."""
    order = np.argsort(x, kind="mergesort")
    ordered = x[order]
    starts = np.empty(len(x), dtype=bool)
    starts[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=starts[1:])
    group = np.cumsum(starts)  # 1-based index of each sorted value's run of ties
    bounds = np.r_[np.flatnonzero(starts), len(x)]  # where each run starts, then n
    ranks = np.empty(len(x))
    ranks[order] = 0.5 * (bounds[group - 1] + bounds[group] + 1)  # mean of the run's ranks start+1 .. end
    return ranks


def fast_auroc(y: np.ndarray, score: np.ndarray) -> float:
    """AUROC by the Mann-Whitney statistic on average ranks (equal to sklearn's roc_auc_score, ties included)."""
    positive = y == 1
    n1, n0 = int(positive.sum()), int((~positive).sum())
    return float((average_ranks(score)[positive].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def gain(x: np.ndarray, y: np.ndarray, seed: int = 0) -> dict:
    """AUROC of (log 1/u, log sigma) against log 1/u alone, both out of fold, with a paired bootstrap interval of the
    difference. ``x``: (n, 2) with log 1/u first."""
    alone, both = out_of_fold(x[:, :1], y, seed), out_of_fold(x, y, seed)
    rng = np.random.default_rng(seed)
    diffs = []
    for _ in range(RESAMPLES):
        i = rng.integers(0, len(y), len(y))
        if y[i].min() == y[i].max():
            continue
        diffs.append(fast_auroc(y[i], both[i]) - fast_auroc(y[i], alone[i]))
    low, high = np.percentile(diffs, [2.5, 97.5])
    a, b = roc_auc_score(y, alone), roc_auc_score(y, both)
    return {"auroc_inv_u": float(a), "auroc_inv_u_and_sigma": float(b), "gain": float(b - a),
            "gain_ci95": [float(low), float(high)], "sigma_adds": bool(low > 0)}


def partial_spearman(a: np.ndarray, b: np.ndarray, given: np.ndarray) -> float:
    """Spearman correlation of ``a`` and ``b`` with ``given`` partialled out: the Pearson correlation of their ranks'
    residuals after a linear fit on the rank of ``given``."""
    ra, rb, rg = average_ranks(a), average_ranks(b), average_ranks(given)
    design = np.c_[np.ones_like(rg), rg]

    def residual(r):
        return r - design @ np.linalg.lstsq(design, r, rcond=None)[0]

    ea, eb = residual(ra), residual(rb)
    return float(np.dot(ea, eb) / np.sqrt(np.dot(ea, ea) * np.dot(eb, eb)))


def partial_spearman_ci(a: np.ndarray, b: np.ndarray, given: np.ndarray, seed: int = 0) -> dict:
    """:func:`partial_spearman` with its 95% interval over bootstrap resamples of the questions."""
    rng = np.random.default_rng(seed)
    draws = [partial_spearman(a[i], b[i], given[i])
             for i in (rng.integers(0, len(a), len(a)) for _ in range(RESAMPLES))]
    low, high = np.percentile(draws, [2.5, 97.5])
    return {"value": partial_spearman(a, b, given), "ci95": [float(low), float(high)]}


def score_candidate(feats: dict, hits: np.ndarray) -> dict:
    """The candidate's record from its per-stream features (``features``) and SciQ validation's right answers."""
    val = feats["sciq_validation"]
    sigma = val["sigma"]
    record = {
        "sigma_median": float(np.median(sigma)), "sigma_cv": float(np.std(sigma) / np.mean(sigma)),
        "accuracy": float(hits.mean()),
        "spearman_sigma_inv_u": {name: float(spearmanr(f["sigma"], f["inv_u"]).statistic) for name, f in feats.items()},
        "in_distribution": {"questions": int(len(hits)),
                            "partial_spearman_sigma_right_given_inv_u": partial_spearman_ci(sigma, hits, val["inv_u"]),
                            **gain(pair(val), hits)},
        "ood": {},
    }
    for s in SHIFTED:
        shifted = feats[f"{s}_dev"]
        x = np.concatenate([pair(val), pair(shifted)])
        y = np.r_[np.ones(len(val["sigma"])), np.zeros(len(shifted["sigma"]))]
        record["ood"][s] = {"questions": int(len(shifted["sigma"])),
                            "auroc_sigma": auroc(val["sigma"], shifted["sigma"]), **gain(x, y)}
    return record


def run_features(run: str, questions: dict, batch_size: int) -> dict:
    """A trained run's per-question 1/u, mean sigma and right answers (1 or 0) on each stream at zeta 0:
    {"streams": {name: {"inv_u": [...], "sigma": [...], "right": [...]}}}."""
    from ibedl.training.calibrate import raw_outputs
    from ibedl.training.experiments.evaluate_run import load_run

    predictor = load_run(run)
    out = {"streams": {}}
    for name, qs in questions.items():
        kind, raw = raw_outputs(predictor, qs, batch_size, progress=True)
        if raw.get("sigma") is None:
            raise SystemExit(f"{run} has no sigma: the search's candidates must be IB-EDL runs")
        f = features(raw, kind, raw["offset"], {})  # {}: the post-hoc parameter neutral (zeta 0)
        right = [int(np.argmax(p) == q.answer) for p, q in zip(raw["probs"], qs, strict=True)]
        out["streams"][name] = {**{k: [float(f"{x:.6g}") for x in f[k]] for k in ("inv_u", "sigma")}, "right": right}
    return out


def candidate_features(c: dict, questions, batch_size: int, scores: Path) -> tuple[dict, np.ndarray]:
    """A candidate's features, from its scores file when it was made with the same overrides, else from the run
    on ``questions()`` (then written there)."""
    path = scores / f"{Path(c['run']).name}.json"
    stored = json.loads(path.read_text()) if path.is_file() else None
    if stored is None or stored["overrides"] != c["overrides"]:
        if not (Path(c["run"]) / "manifest.json").is_file():
            raise FileNotFoundError(f"{c['run']} is not on this machine: train it with benchmarks.hparam_search")
        stored = {"run": c["run"], "overrides": c["overrides"], "zeta": 0,
                  **run_features(c["run"], questions(), batch_size)}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(stored) + "\n")
    feats = {name: {k: np.asarray(v) for k, v in f.items()} for name, f in stored["streams"].items()}
    # SciQ validation's right answers: its stream's own; files scored before streams kept them hold "hits"
    hits = stored["hits"] if "hits" in stored else stored["streams"]["sciq_validation"]["right"]
    return feats, np.asarray(hits, dtype=float)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sigma_search", description=__doc__.split("\n\n")[0])
    parser.add_argument("--search", default=str(SEARCH), help="the search's results (benchmarks.hparam_search)")
    parser.add_argument("--output", default=str(OUTPUT))
    parser.add_argument("--scores", default=str(SCORES), help="per-candidate 1/u and sigma (read, or written)")
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args(argv)
    search = Path(args.search)
    if not search.is_file():
        print(f"error: no search results at {search}: run python -m benchmarks.hparam_search "
              "--config benchmarks/sciq_sigma_search.yaml first", file=sys.stderr)
        return 2
    candidates = json.loads(search.read_text())["candidates"]
    if not candidates:
        print(f"error: {search} lists no trained candidate yet", file=sys.stderr)
        return 2
    loaded = {}

    def questions() -> dict:  # the validation streams, loaded when a candidate must be run through its model
        if not loaded:
            loaded.update(streams(0, test=False))
        return loaded

    records = []
    for c in candidates:
        try:
            feats, hits = candidate_features(c, questions, args.batch_size, Path(args.scores))
        except FileNotFoundError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        records.append({"index": c["index"], "overrides": c["overrides"], "run": c["run"],
                        "validation_nll": c["validation_end"]["nll"], **score_candidate(feats, hits)})
    result = {"command": "python -m benchmarks.sigma_search " + " ".join(argv if argv is not None else sys.argv[1:]),
              "search": str(search), "split": "validation only", "zeta": 0, "folds": FOLDS, "resamples": RESAMPLES,
              "questions": {name: len(f["inv_u"]) for name, f in feats.items()}, "candidates": records,
              "sigma_adds_anywhere": any(r["in_distribution"]["sigma_adds"] or
                                         any(o["sigma_adds"] for o in r["ood"].values()) for r in records)}
    write_result(args.output, result, echo=False)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
