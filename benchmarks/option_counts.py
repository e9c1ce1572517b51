"""An artifact's promises for every option count it claims, measured on SciQ test questions asked with 2 to 6
options (built as calibration builds them: ibedl.training.data.option_counts), under the calibration of the backend
that computed them:

    python -m benchmarks.option_counts score [--artifact artifacts/default] [--backend openvino-int8] [--counts 2,3,5,6]
    python -m benchmarks.option_counts analyse [--artifact artifacts/default] [--backend openvino-int8]
    python -m benchmarks.option_counts table [--backends openvino-int8 openvino-bf16 openvino-fp32 torch]

``score`` runs the model once over the test variants (4 options: SciQ as it is) and keeps the raw outputs in
``benchmarks/results/decision_scores/<artifact>-<backend>-test-options.json`` (resumable per count); ``analyse``
serves them as the service does (each count's own gate, threshold and set when the calibration covers it) and
writes ``benchmarks/results/option_counts_<artifact>_<backend>.json``: per count the accuracy, the gate's refusals,
the answered share and accuracy, the sets' coverage, whether the calibration claims the count, and the checks of
:func:`checks` (family-wise over the claimed counts); ``table`` prints the docs' rows from those reports. The test
split is read once, for this report.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from benchmarks.common import write_result
from ibedl.core.artifact import read_manifest
from ibedl.core.conformal import conformal_rank, prediction_set
from ibedl.engine.abstention import decide
from ibedl.training.calibrate import posthoc_outputs
from ibedl.training.data.option_counts import parse_counts

SCORES = Path("benchmarks/results/decision_scores")


def outputs_path(artifact, backend: str) -> Path:
    """Where ``score`` keeps the raw outputs of ``artifact``'s test variants on ``backend`` (named by the artifact's
    directory: ``default-openvino-int8-test-options.json``)."""
    return SCORES / f"{Path(artifact).name}-{backend}-test-options.json"


def score(args) -> int:
    from ibedl.core.cpu_isa import int8_isa
    from ibedl.core.predictor import Predictor
    from ibedl.training.calibrate import raw_outputs, save_outputs
    from ibedl.training.data import load_dataset
    from ibedl.training.data.option_counts import vary_option_counts

    questions = load_dataset("sciq", "test")
    predictor = Predictor.from_artifact(args.artifact, backend=args.backend)
    predictor.max_tokens = args.max_tokens
    path = outputs_path(args.artifact, args.backend)
    done = json.loads(path.read_text())["streams"] if path.is_file() else {}
    for count in (4, *args.counts):
        name = f"sciq_test_{count}_options"
        if name in done:
            continue
        asked = questions if count == 4 else vary_option_counts(questions, (count,), seed=args.seed)
        kind, raw = raw_outputs(predictor, asked, args.batch_size, progress=not args.no_progress)
        done[name] = {"labels": [q.answer for q in asked], **raw}
        extra = {"calibration_key": predictor.calibration_key,
                 **({"int8_isa": int8_isa()} if predictor.backend == "openvino-int8" else {})}
        save_outputs(path, Path(args.artifact), predictor.manifest, done, kind, raw["offset"], args.max_tokens,
                     extra=extra)
        print(f"{name}: {len(asked)} questions", file=sys.stderr, flush=True)
    return 0


FAMILY = 0.02  # the family-wise error of the per-count checks, split over the claimed counts (Bonferroni)


def beta_binomial_quantile(q: float, m: int, k: int, n: int) -> float:
    """The q-quantile of BetaBinomial(m, k, n + 1 - k) / m: what m test questions measure of a rule set at the k-th
    smallest of n exchangeable scores (its level ~ Beta(k, n + 1 - k), then Binomial(m, level) / m)."""
    from scipy.stats import betabinom

    return 1.0 if k > n else float(betabinom.ppf(q, m, k, n + 1 - k) / m)


def binomial_quantile(q: float, m: int, p: float) -> float:
    from scipy.stats import binom

    return float(binom.ppf(q, m, p) / m)


def checks(row: dict, rank_gate: int | None, n_gate: int, rank_set: int, n_set: int, alpha_set: float,
           family: int) -> dict:
    """The per-count checks of issue 55 for one claimed count, each at the family-wise level FAMILY / ``family``:

    - answered accuracy: the one-sided exact binomial test of "accuracy >= target" is not rejected (the promise);
    - set coverage inside [L, U]: L the lower quantile of Binomial(m, 1 - alpha) / m (what the promise allows at
      worst), U the upper quantile of BetaBinomial(m, k, n + 1 - k) / m (what the PAC rank predicts at most);
    - gate refusals inside [the lower quantile of the rank's BetaBinomial, the upper quantile of Binomial(m,
      stated rate)]: the promise bounds it above, the rank's law below.
    """
    from scipy.stats import binom

    level = FAMILY / family
    m = row["questions"]
    out = {}
    answered = round(row["answered"] * m)
    if answered and row["answered_accuracy"] is not None:
        right = round(row["answered_accuracy"] * answered)
        p = float(binom.cdf(right, answered, row["target_accuracy"]))
        out["answered_accuracy_p_value"] = p
        out["answered_accuracy_not_below_target"] = p > level / 2
    low = binomial_quantile(level / 2, m, 1.0 - alpha_set)
    high = beta_binomial_quantile(1.0 - level / 2, m, rank_set, n_set)
    out["set_coverage_range"] = [low, high]
    out["set_coverage_in_range"] = low <= row["set_coverage"] <= high
    if rank_gate and row["gate_stated_rate"]:
        g_low = beta_binomial_quantile(level / 2, m, rank_gate, n_gate)
        g_high = binomial_quantile(1.0 - level / 2, m, row["gate_stated_rate"])
        out["gate_refused_range"] = [g_low, g_high]
        out["gate_refused_in_range"] = g_low <= row["gate_refused"] <= g_high
    return out


def analyse(args) -> int:
    manifest = read_manifest(Path(args.artifact))
    dump = json.loads(outputs_path(args.artifact, args.backend).read_text())
    calibration = manifest.calibration_for(dump["calibration_key"])
    claimed = calibration.record.get("option_counts")
    gate = calibration.record.get("gate", {})
    rows = {}
    for name, stream in sorted(dump["streams"].items(), key=lambda kv: int(kv[0].split("_")[2])):
        count = int(name.split("_")[2])
        outputs = posthoc_outputs(dump["kind"], {**stream, "offset": dump["offset"]}, calibration.head)
        labels = np.asarray(stream["labels"])
        limits = calibration.thresholds.for_options(count)
        conformal = calibration.conformal.for_options(count)
        u, conf = outputs.uncertainty, outputs.confidence
        reasons = [decide(None if u is None else float(u[i]), float(conf[i]), limits) for i in range(len(labels))]
        hits = np.asarray([int(np.argmax(p)) == y for p, y in zip(outputs.probs, labels, strict=True)])
        answered = np.asarray([r is None for r in reasons])
        q = conformal.quantile()
        sets = [prediction_set(p, q, conformal.score) for p in outputs.probs]
        covered = np.asarray([int(y) in s for y, s in zip(labels, sets, strict=True)])
        refused = float(np.mean([r == "out_of_distribution" for r in reasons]))
        target, nominal = limits.how.get("target_accuracy"), 1.0 - conformal.alpha
        rate = gate.get("rejection_rate")
        rows[count] = {
            "questions": int(len(labels)), "claimed": claimed is None or count in claimed,
            "own_calibration": str(count) in calibration.thresholds.by_options,
            "accuracy": float(hits.mean()), "gate_refused": refused, "gate_stated_rate": rate,
            "answered": float(answered.mean()),
            "answered_accuracy": float(hits[answered].mean()) if answered.any() else None,
            "target_accuracy": target, "certified": bool(limits.how.get("certified")),
            "set_coverage": float(covered.mean()), "nominal_coverage": nominal,
            "mean_set_size": float(np.mean([len(s) for s in sets])),
        }
        per_count = (calibration.record.get("by_options") or {}).get(str(count), calibration.record)
        n_fit = int(per_count.get("gate", {}).get("n", 0))
        gate_delta = per_count.get("gate", {}).get("delta")
        rank_gate = None
        if rate and n_fit:
            rank_gate = (n_fit + 1 - conformal_rank(n_fit, rate, gate_delta) if gate_delta
                         else int(np.floor(rate * (n_fit + 1))))
        rows[count]["_ranks"] = (rank_gate, n_fit, conformal_rank(conformal.n, conformal.alpha, conformal.delta),
                                 conformal.n, conformal.alpha)
    family = max(1, sum(r["claimed"] for r in rows.values()))
    for count, row in rows.items():
        row["checks"] = checks(row, *row.pop("_ranks"), family) if row["claimed"] else {}
        print(f"{count} options: {row}", file=sys.stderr)
    met = all(all(v for k, v in r["checks"].items() if isinstance(v, bool)) for r in rows.values() if r["claimed"])
    result = {
        "artifact": args.artifact, "version": str(manifest.version), "backend": dump["calibration_key"],
        "int8_isa": dump.get("int8_isa"), "outputs": str(outputs_path(args.artifact, args.backend)),
        "calibration_command": calibration.record.get("command"), "claimed_option_counts": claimed,
        "family_wise_error": FAMILY, "counts": rows, "checks_met": met,
    }
    write_result(args.output or f"benchmarks/results/option_counts_{Path(args.artifact).name}_{args.backend}.json",
                 result)
    return 0


def table(args) -> int:
    """The docs' table (markdown, stdout) from the committed reports of ``--backends`` (one row per backend and
    count)."""
    reports = [json.loads(Path(f"benchmarks/results/option_counts_{Path(args.artifact).name}_{b}.json").read_text())
               for b in args.backends]
    first = next(iter(reports[0]["counts"].values()))
    print(f"| backend | options | accuracy | gate refused (stated {100 * first['gate_stated_rate']:g}%; range) | "
          f"answered | answered accuracy (target {first['target_accuracy']:g}; binomial p) | set coverage (nominal "
          f"{first['nominal_coverage']:g}; range) | set size |")
    print("|---|---|---|---|---|---|---|---|")
    for report in reports:
        for count, r in report["counts"].items():
            c = r["checks"]
            gate = c.get("gate_refused_range")
            accuracy = ("(none answered)" if r["answered_accuracy"] is None else
                        f"{100 * r['answered_accuracy']:.1f}% (p {c['answered_accuracy_p_value']:.3f})")
            print(f"| {report['backend']} | {count} | {100 * r['accuracy']:.1f}% | {100 * r['gate_refused']:.1f}%"
                  + (f" ({100 * gate[0]:.1f}-{100 * gate[1]:.1f}%)" if gate else "")
                  + f" | {100 * r['answered']:.1f}% | {accuracy} | {r['set_coverage']:.3f} "
                  f"({c['set_coverage_range'][0]:.3f}-{c['set_coverage_range'][1]:.3f}) | {r['mean_set_size']:.2f} |")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.option_counts", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("score", "analyse"):
        p = sub.add_parser(name)
        p.add_argument("--artifact", default="artifacts/default")
        p.add_argument("--backend", default="openvino-int8", help="the backend to run and whose calibration serves")
    s = sub.choices["score"]
    s.add_argument("--counts", default="2,3,5,6", type=parse_counts)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--batch-size", type=int, default=8)
    s.add_argument("--max-tokens", type=int, default=1024)
    s.add_argument("--no-progress", action="store_true")
    sub.choices["analyse"].add_argument("--output", help="default benchmarks/results/option_counts_<artifact>_<backend>"
                                        ".json")
    t = sub.add_parser("table", help="the docs' table from the committed reports")
    t.add_argument("--artifact", default="artifacts/default")
    t.add_argument("--backends", nargs="+", default=["openvino-int8", "openvino-bf16", "openvino-fp32", "torch"])
    args = parser.parse_args(argv)
    try:
        return {"score": score, "analyse": analyse, "table": table}[args.command](args)
    except (ValueError, FileNotFoundError) as e:  # a missing artifact or scores, an unknown backend: one line
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
