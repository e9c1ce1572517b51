"""Paired bootstrap intervals for the paper's claims on a grid's kept per-question predictions
(benchmarks.grid_predictions), per seed, pooled over the seeds and for a seed drawn at random, and how far each
claim holds.

    python -m benchmarks.grid_intervals --grid sciq_grid_shared_lr [--resamples 2000] [--seed 0]
        [--output benchmarks/results/<grid>_intervals.json]

A claim (benchmarks.paper_comparison.CLAIMS) is a difference ``a - b`` of two rows' metric on the same questions
(``b`` the best of several rows where it names several: chosen on each seed's full set, then held fixed). The test
questions are resampled with replacement, the same resample for both rows (paired); for an OOD claim the
in-distribution questions and each shifted stream's are resampled independently and the AUROC difference is averaged
over the streams. The pooled interval resamples the questions once per draw and averages the seeds' differences on
them (every seed answers the same test questions: checked), so it carries the test set's sampling error of the mean
over these seeds, not the spread a new seed would add; the per-seed intervals show that spread. The interval over
seeds and questions carries both: a 95% interval for the expected difference of a seed drawn at random, its
half-width sqrt((t s / sqrt(n))^2 + (z sqrt(v))^2), s the seeds' standard deviation of their full-set differences,
t Student's 97.5% quantile at n - 1 degrees of freedom, v the variance of the pooled resamples and z the normal
quantile: exact where either error is absent, wide (never narrow) where both are, as simulated in its tests.

``--against GRID`` takes ``--grid`` as an arm run beside ``GRID`` (``benchmarks/<arm>.yaml`` training only some
methods on GRID's questions, e.g. IB-EDL as the paper specifies it): its rows replace GRID's for its methods and the
claims are tested on GRID's runs with them (benchmarks.grid_predictions.beside; the labels are checked equal). It
also tests the arm against GRID's own rows of the same methods (``head_to_head``: the arm minus GRID on accuracy,
ECE and NLL at zeta 0 and on 1/u's mean AUROC; on a seed "holds" where the interval says the arm is better).

On a seed a claim ``holds`` when its 95% interval lies wholly on the claimed side of 0 (for a no-worse claim: wholly
above minus the tolerance), ``direction`` when only the point estimate does, else ``no``; ``against`` marks an
interval wholly on the other side (the data speak against the claim, not merely cannot tell). The pooled interval
and the one over seeds get the same words.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import numpy as np
from scipy.stats import norm as normal
from scipy.stats import rankdata
from scipy.stats import t as student_t

from benchmarks.common import write_result
from benchmarks.grid_predictions import GridPredictions, beside, default_path, load, tagged
from benchmarks.paired_bootstrap import PerQuestion
from ibedl.core.paths import check_writable
from ibedl.training.experiments.benchmark import Run, expand, load_benchmark_config
from ibedl.training.experiments.report import NO_POSTHOC
from ibedl.training.methods import get_method

LEVEL = (2.5, 97.5)


def train_key(run: Run) -> str:
    return run.train_key(get_method(run.method).trained_as)


def rows_of(preds: GridPredictions, run: Run, method_row: str, dataset: str) -> dict:
    """The kept predictions of a claim's row (a method, ``<method>:no_posthoc`` for the row without its post-hoc
    step) in ``run``'s trained run on ``dataset``."""
    bare = method_row.endswith(NO_POSTHOC)
    method = method_row.removesuffix(NO_POSTHOC)  # <method>@<tag>: an arm's rows kept beside the grid's (tagged)
    cell = Run(run.experiment, run.kind, run.dataset, method.partition("@")[0], run.seed, run.eval_sets,
               run.label_noise)
    return preds.get(train_key(cell), method, dataset, bare=bare)


def resampled_auroc(pos: np.ndarray, neg: np.ndarray, pos_index: np.ndarray, neg_index: np.ndarray) -> np.ndarray:
    """AUROC (positives should score higher; ties one half) on each resample: ``pos`` (N1,), ``neg`` (N2,) scores,
    ``pos_index`` (R, N1) and ``neg_index`` (R, N2) resampled positions -> (R,)."""
    scores = np.concatenate([pos[pos_index], neg[neg_index]], axis=1)
    ranks = rankdata(scores, axis=1)
    n1, n2 = pos_index.shape[1], neg_index.shape[1]
    return (ranks[:, :n1].sum(1) - n1 * (n1 + 1) / 2) / (n1 * n2)


def ood_score(rows: dict, score: str) -> np.ndarray:
    """Per question, the score whose AUROC a claim compares: ``mp`` max probability, ``um`` 1/u (as -u: same order)."""
    if score == "mp":
        return np.array([p.max() for p in rows["probs"]])
    if score == "um":
        if rows["uncertainty"] is None:
            raise ValueError("the 1/u score needs an evidential method's uncertainty")
        return -rows["uncertainty"]
    raise ValueError(f"unknown OOD score {score!r}; expected mp or um")


def verdict(claim, low: float, high: float, point: float) -> str:
    """``holds`` (the interval on the claimed side, :meth:`Claim.on_side`; ``no_worse``: above ``-tolerance``),
    ``direction`` (only the point) or ``no``."""
    if claim.on_side(low) and claim.on_side(high):
        return "holds"
    return "direction" if claim.on_side(point) else "no"


def against(claim, low: float, high: float) -> bool:
    """Whether the 95% interval lies wholly on the other side of the claim (``no_worse``: wholly below
    ``-tolerance``): the data speak against it, beyond "cannot tell"."""
    return claim.beyond(low) and claim.beyond(high)


def judged(claim, point: float, low: float, high: float) -> dict:
    """An interval's entry: the point, the 95% interval, its :func:`verdict` and whether it lies :func:`against`."""
    return {"difference": point, "ci95": [low, high], "verdict": verdict(claim, low, high, point),
            "against": against(claim, low, high)}


def over_seeds(claim, differences: list[float], question_variance: float) -> dict | None:
    """A 95% interval for the expected difference of a seed drawn at random around the mean of the seeds' full-set
    ``differences`` (n,): half-width sqrt((t s / sqrt(n))^2 + (z sqrt(v))^2), s their standard deviation, t
    Student's 97.5% quantile at n - 1 degrees of freedom, v = ``question_variance`` (the pooled mean's variance over
    resampled test questions, taken as known) and z the normal 97.5% quantile. It carries both the seeds' spread
    and the test set's sampling error: exact where either is absent, wide where both are (the seed-by-question part
    enters both terms). Its verdict as :func:`verdict`'s. None under 2 seeds."""
    values = np.asarray(differences, dtype=np.float64)
    if not np.isfinite(values).all() or not np.isfinite(question_variance) or question_variance < 0:
        raise ValueError(f"differences and the question variance must be finite (variance >= 0), got {differences} "
                         f"and {question_variance}")
    n = len(values)
    if n < 2:
        return None
    mean = float(values.mean())
    half = float(np.hypot(student_t.ppf(0.975, n - 1) * values.std(ddof=1) / np.sqrt(n),
                          normal.ppf(0.975) * np.sqrt(question_variance)))
    return judged(claim, mean, mean - half, mean + half)


class ClaimDraws:
    """The resampled differences of one claim on one seed: ``full`` the difference on all questions, ``draws`` (R,)."""

    def __init__(self, full: float, draws: np.ndarray):
        self.full, self.draws = full, draws


def id_draws(claim, preds: GridPredictions, run: Run, index: np.ndarray) -> ClaimDraws:
    """A calibration claim's difference on ``run``'s seed: ``index`` (R, N) resampled question positions."""
    dataset = run.eval_sets[0]
    full = np.arange(index.shape[1])[None, :]

    def per_question(row) -> PerQuestion:
        got = rows_of(preds, run, row[0], dataset)
        return PerQuestion.from_probs(got["probs"], got["labels"])

    a, bs = per_question(claim.a), [(row, per_question(row)) for row in claim.b]
    metric = claim.a[1]
    b_full = [float(q.metrics(full)[row[1]][0]) for row, q in bs]
    pick = b_full.index(claim.best(b_full))
    (b_row, b) = bs[pick]
    diff = a.metrics(index)[metric] - b.metrics(index)[b_row[1]]
    return ClaimDraws((float(a.metrics(full)[metric][0]) - b_full[pick]) * claim.scale, diff * claim.scale)


def ood_draws(claim, preds: GridPredictions, run: Run, indices: dict[str, np.ndarray]) -> ClaimDraws:
    """An OOD claim's difference on ``run``'s seed: the AUROC of ``a``'s score minus ``b``'s, averaged over the
    shifted streams; ``indices``: set -> (R, N_set) resampled positions."""
    first, streams = run.eval_sets[0], run.eval_sets[1:]

    def aurocs(row) -> tuple[float, np.ndarray]:
        id_scores = ood_score(rows_of(preds, run, row[0], first), row[1])
        full, draws = [], []
        for stream in streams:
            scores = ood_score(rows_of(preds, run, row[0], stream), row[1])
            n1, n2 = len(id_scores), len(scores)
            full.append(resampled_auroc(id_scores, scores, np.arange(n1)[None, :], np.arange(n2)[None, :])[0])
            draws.append(resampled_auroc(id_scores, scores, indices[first], indices[stream]))
        return float(np.mean(full)), np.mean(draws, axis=0)

    a_full, a_draws = aurocs(claim.a)
    bs = [aurocs(row) for row in claim.b]
    b_full, b_draws = bs[[f for f, _ in bs].index(claim.best([f for f, _ in bs]))]
    return ClaimDraws((a_full - b_full) * claim.scale, (a_draws - b_draws) * claim.scale)


def claim_runs(claim, runs: list[Run], preds: GridPredictions) -> list[Run]:
    """The grid's runs of the claim's kind on which every row it names has kept predictions, one per seed."""
    found = {}
    for run in runs:
        if run.kind != claim.kind or run.seed in found:
            continue
        try:
            for row in (claim.a, *claim.b):
                for dataset in run.eval_sets:
                    rows_of(preds, run, row[0], dataset)
        except KeyError:
            continue
        found[run.seed] = run
    return [found[s] for s in sorted(found)]


def same_questions(preds: GridPredictions, runs: list[Run], row: str) -> dict[str, int]:
    """Each evaluation set's size, after checking that every seed answered the same questions (equal labels)."""
    sizes = {}
    for dataset in runs[0].eval_sets:
        labels = [rows_of(preds, run, row, dataset)["labels"] for run in runs]
        if any(len(x) != len(labels[0]) or (x != labels[0]).any() for x in labels):
            raise ValueError(f"the seeds answered different {dataset} questions: no pooled paired interval")
        sizes[dataset] = len(labels[0])
    return sizes


def claim_interval(claim, runs: list[Run], preds: GridPredictions, resamples: int = 2000, seed: int = 0) -> dict:
    """Per seed and pooled: the claim's difference on the full set, its 95% interval over paired resamples and its
    verdict; with two seeds or more, ``over_seeds`` (:func:`over_seeds`); ``{"seeds": 0}`` where no seed has every
    row."""
    if resamples < 100:
        raise ValueError(f"resamples must be at least 100, got {resamples}")
    runs = claim_runs(claim, runs, preds)
    if not runs:
        return {"seeds": 0}
    sizes = same_questions(preds, runs, claim.a[0])
    rng = np.random.default_rng(seed)
    indices = {d: rng.integers(0, n, size=(resamples, n)) for d, n in sizes.items()}
    draws = {run.seed: (ood_draws(claim, preds, run, indices) if claim.kind == "ood"
                        else id_draws(claim, preds, run, indices[run.eval_sets[0]])) for run in runs}

    def summary(full: float, values: np.ndarray) -> dict:
        return judged(claim, full, *(float(x) for x in np.percentile(values, LEVEL)))

    per_seed = {s: summary(d.full, d.draws) for s, d in draws.items()}
    pooled_draws = np.mean([d.draws for d in draws.values()], axis=0)
    pooled = summary(float(np.mean([d.full for d in draws.values()])), pooled_draws)
    seeds = over_seeds(claim, [d.full for d in draws.values()], float(np.var(pooled_draws, ddof=1)))
    return {"seeds": len(runs), "per_seed": per_seed, "pooled": pooled, **({"over_seeds": seeds} if seeds else {}),
            "held_on": sum(v["verdict"] == "holds" for v in per_seed.values()),
            "direction_on": sum(v["verdict"] in ("holds", "direction") for v in per_seed.values()),
            "against_on": sum(v["against"] for v in per_seed.values())}


def over_confidence(preds: GridPredictions, runs: list[Run], method: str, resamples: int = 2000,
                    seed: int = 0) -> dict:
    """Per seed of ``method``'s in-distribution cells that have kept predictions: accuracy, mean confidence, their
    gap (confidence minus accuracy: above 0 is over-confident) and ECE, each with its 95% interval over resampled
    questions."""
    out = {}
    for run in runs:
        if run.kind != "id" or run.method != method:
            continue
        try:
            got = rows_of(preds, run, method, run.eval_sets[0])
        except KeyError:  # a cell not run (yet): the grid's other seeds
            continue
        q = PerQuestion.from_probs(got["probs"], got["labels"])
        n = len(q.hit)
        index = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
        full, boot = q.metrics(np.arange(n)[None, :]), q.metrics(index)
        gap, gap_full = q.confidence[index].mean(1) - boot["accuracy"], q.confidence.mean() - full["accuracy"][0]
        out[run.seed] = {
            "accuracy": float(full["accuracy"][0]), "mean_confidence": float(q.confidence.mean()),
            "over_confidence": {"value": float(gap_full), "ci95": [float(x) for x in np.percentile(gap, LEVEL)]},
            "ece": {"value": float(full["ece"][0]), "ci95": [float(x) for x in np.percentile(boot["ece"], LEVEL)]},
        }
    return out


def kept_seeds(config: dict, preds: GridPredictions) -> dict:
    """``config`` with its seed lists widened to every seed whose predictions are kept: a seed run beyond the
    config's (``'seeds=[3]'`` on the runner's command, which is every experiment's seeds, the noise experiment's own
    list included) enters the claims whose rows it has; a claim skips a seed whose rows are not all kept."""
    kept = preds.seeds()
    return {**config, "seeds": sorted(set(config["seeds"]) | kept),
            "experiments": [{**exp, "seeds": sorted(set(exp["seeds"]) | kept)} if "seeds" in exp else exp
                            for exp in config["experiments"]]}


ARM_TAG = "arm"  # the arm's rows beside the grid's in a head-to-head


def main(argv: list[str] | None = None) -> int:
    from benchmarks.paper_comparison import CLAIMS, head_to_head

    parser = argparse.ArgumentParser(prog="python -m benchmarks.grid_intervals", description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", required=True, help="the grid's name: benchmarks/<grid>.yaml")
    parser.add_argument("--predictions",
                        help="its kept predictions (default benchmarks/results/<grid>.predictions.npz)")
    parser.add_argument("--against", metavar="GRID",
                        help="--grid is an arm beside this grid: its rows replace GRID's for its methods, tested on "
                             "GRID's runs (both grids' kept predictions at their default paths)")
    parser.add_argument("--resamples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0, help="seed of the resamples")
    parser.add_argument("--output", help="default benchmarks/results/<grid>_intervals.json")
    args = parser.parse_args(argv)
    if args.resamples < 100:
        parser.error(f"--resamples must be at least 100, got {args.resamples}")
    output = args.output or f"benchmarks/results/{args.grid}_intervals.json"
    try:
        check_writable(output, "--output")  # before the resampling, not after it
        config = load_benchmark_config(Path("benchmarks") / f"{args.against or args.grid}.yaml")
        preds = arm = load(args.predictions or default_path(args.grid))
        if args.against:
            grid = load(default_path(args.against))
            preds = beside(grid, arm)
        runs = expand(kept_seeds(config, preds))
        claims = {c.text: claim_interval(c, runs, preds, args.resamples, args.seed) for c in CLAIMS}
        if args.against:
            both = GridPredictions({**grid.arrays, **tagged(arm, ARM_TAG).arrays})
            head = {c.text: claim_interval(c, runs, both, args.resamples, args.seed) for c in head_to_head(ARM_TAG)}
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_result(output, {
        "grid": args.grid, **({"against": args.against} if args.against else {}),
        "resamples": args.resamples, "seed": args.seed, "level": "95% percentile interval",
        "command": "python -m benchmarks.grid_intervals " + shlex.join(sys.argv[1:] if argv is None else argv),
        "map_over_confidence": over_confidence(preds, runs, "map", args.resamples, args.seed),
        "claims": claims, **({"head_to_head": head} if args.against else {})})
    return 0


if __name__ == "__main__":
    sys.exit(main())
