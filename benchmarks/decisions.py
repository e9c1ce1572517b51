"""Decisions under shift: the OOD gate, risk-controlled abstention and conformal sets of calibrated adapters,
measured on in-distribution and shifted question streams.

Two steps, so that the model runs once (a GPU helps) and the analysis reruns anywhere in seconds:

    python -m benchmarks.decisions score --artifact artifacts/default \
        --output benchmarks/results/decision_scores/default.json
    python -m benchmarks.decisions score --artifact artifacts/map-twin \
        --output benchmarks/results/decision_scores/map-twin.json
    python -m benchmarks.decisions analyse --adapter default=artifacts/default --adapter map-twin=artifacts/map-twin \
        [--scores-dir benchmarks/results/decision_scores] [--splits 200] [--output benchmarks/results/decisions.json]

``score`` answers every stream with the head's post-hoc parameter neutral (raw outputs) and stores, per
question, the probabilities, alpha and sigma, its label and option count. Streams:

  sciq_validation        SciQ validation with passages: the calibration sample (ibedl.training.calibrate's data)
  sciq_test              SciQ test with passages (in distribution, read once for this report)
  sciq_no_passage        the same questions without their passage
  obqa                   OpenBookQA test (no passage)
  arc_easy, arc_challenge  ARC test (no passage; 3-5 options)
  race_no_article        RACE test without its article
  <shifted>_dev          the same five shifts drawn from validation splits (SciQ validation without passages,
                         OBQA/ARC/RACE dev): design choices are checked there, never on the test streams

``analyse`` applies each artifact's manifest exactly as the service does (post-hoc parameter, gate, risk
threshold, conformal quantile) and reports per stream the share answered and the accuracy of what was answered,
the sets' coverage and size; then, over ``--splits`` random halvings of SciQ test into calibration and test
parts, the empirical coverage of the sets and how often the accuracy guarantee held when the thresholds are
chosen on the calibration half; and writes a risk-coverage plot beside the JSON.

``compare`` puts a paired interval on the OOD AUROC difference of two adapters (in distribution against each shifted
stream, each scored by its served ``ood_score``): both answered the same questions, so each bootstrap resample draws
the same SciQ test and shifted questions for both.

    python -m benchmarks.decisions compare --adapter default=artifacts/default --against map-twin=artifacts/map-twin
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from benchmarks.common import write_result
from ibedl.core.artifact import read_manifest
from ibedl.core.conformal import SCORES, conformal_quantile, label_scores, prediction_set
from ibedl.engine.abstention import decide
from ibedl.training import metrics
from ibedl.training.calibrate import CalibrationConfig, calibrate_outputs, posthoc_outputs, weights_sha256
from ibedl.training.experiments.evaluate_run import sigma_summary
from ibedl.training.risk_control import control_accuracy

STREAM_LIMIT = 1000
DEV_LIMIT = 300  # questions per validation-split shifted stream (enough to compare design choices)
SHIFTED = ("sciq_no_passage", "obqa", "arc_easy", "arc_challenge", "race_no_article")


def streams(limit: int, dev_limit: int = DEV_LIMIT, test: bool = True) -> dict:
    """The calibration sample, SciQ test, and each shifted stream twice: from the datasets' validation splits
    (``<name>_dev``: where design choices are checked) and from their test splits (the report). ``test=False``:
    the validation streams only (SciQ validation and the ``_dev`` streams)."""
    from ibedl.training.data import load_dataset

    bare = lambda qs: [dataclasses.replace(q, context=None) for q in qs]  # noqa: E731
    sciq_val = load_dataset("sciq", "validation")
    out = {"sciq_validation": sciq_val}
    if test:
        out["sciq_test"] = load_dataset("sciq", "test")
    splits = [("validation", "_dev", dev_limit)] + ([("test", "", limit)] if test else [])
    for split, suffix, n in splits:
        out["sciq_no_passage" + suffix] = bare(load_dataset("sciq", "validation", limit=n, seed=0) if suffix
                                               else out["sciq_test"])
        for name in ("obqa", "arc_easy", "arc_challenge"):
            out[name + suffix] = load_dataset(name, split, limit=n, seed=0)
        out["race_no_article" + suffix] = bare(load_dataset("race", split, limit=n, seed=0))
    return out


def score(args) -> int:
    import torch

    from ibedl.core.predictor import Predictor
    from ibedl.training.calibrate import raw_outputs, save_outputs

    predictor = Predictor.from_artifact(args.artifact, device=args.device,
                                        dtype=getattr(torch, args.dtype) if args.dtype else None)
    predictor.max_tokens = args.max_tokens  # the service's limit: served prompts are read whole
    path = Path(args.output)
    done = json.loads(path.read_text())["streams"] if path.is_file() and args.resume else {}
    wanted = streams(args.limit, args.dev_limit)
    for name in args.streams.split(",") if args.streams else wanted:
        if name in done:
            continue
        questions = wanted[name]
        kind, raw = raw_outputs(predictor, questions, args.batch_size, progress=not args.no_progress)
        done[name] = {"labels": [q.answer for q in questions], **raw, "device": str(predictor.device)}
        # Written after every stream, so an interrupted run resumes (--resume) where it stopped.
        save_outputs(path, Path(args.artifact), predictor.manifest, done, kind, raw["offset"], args.max_tokens)
        print(f"{name}: {len(questions)} questions", file=sys.stderr, flush=True)
    print(f"wrote {path}", file=sys.stderr)
    return 0


def load_dump(scores_dir: str, name: str, manifest) -> dict:
    """The stored raw outputs ``<scores_dir>/<name>.json``, refused when other weights than the artifact's made them."""
    dump = json.loads((Path(scores_dir) / f"{name}.json").read_text())
    if dump["weights_sha256"] != weights_sha256(Path(dump["artifact"]), manifest):
        raise SystemExit(f"the scores in {name}.json were produced by other weights than {dump['artifact']}: "
                         "score again")
    return dump


def served(dump: dict, stream: str, manifest, key: str | None = None) -> dict:
    """Per-question outputs and decisions of one stream under the manifest's calibration made on ``key`` (default
    its ``calibrated_on``), as served."""
    calibration = manifest.calibration_for(key or manifest.calibrated_on)
    raw = {**dump["streams"][stream], "offset": dump["offset"]}
    outputs = posthoc_outputs(dump["kind"], raw, calibration.head)
    labels = np.asarray(raw["labels"])
    conf = outputs.confidence
    u = outputs.uncertainty
    limits = calibration.thresholds  # each question under its option count's own, when calibrated per count
    reasons = [decide(None if u is None else float(u[i]), float(conf[i]), limits.for_options(len(outputs.probs[i])))
               for i in range(len(labels))]
    hits = np.asarray([float(np.argmax(p) == y) for p, y in zip(outputs.probs, labels, strict=True)])
    sigma = raw.get("sigma")  # IB-EDL: per question, the mean over its options
    return {"outputs": outputs, "labels": labels, "confidence": conf, "hits": hits, "reasons": reasons,
            "answered": np.asarray([r is None for r in reasons]),
            "sigma": None if sigma is None else [float(np.mean(q)) for q in sigma]}


def stream_row(s: dict, conformal) -> dict:
    answered = s["answered"]
    row = {
        "n": int(len(answered)),
        "accuracy": float(s["hits"].mean()),
        "mean_confidence": float(s["confidence"].mean()),
        "answered": float(answered.mean()),
        "answered_accuracy": float(s["hits"][answered].mean()) if answered.any() else None,
        "abstained_out_of_distribution": float(np.mean([r == "out_of_distribution" for r in s["reasons"]])),
        "abstained_min_confidence": float(np.mean([r == "min_confidence" for r in s["reasons"]])),
    }
    if s["outputs"].uncertainty is not None:
        row["mean_u"] = float(s["outputs"].uncertainty.mean())
    if s.get("sigma") is not None:  # is IB-EDL's sigma informative: its spread, in distribution and per shift
        row["sigma"] = sigma_summary(s["sigma"])
    if conformal is not None:  # each question's set under its option count's quantile, as served
        sets = [prediction_set(p, conformal.for_options(len(p)).quantile(), conformal.score)
                for p in s["outputs"].probs]
        row["set_coverage"] = float(np.mean([y in m for y, m in zip(s["labels"], sets, strict=True)]))
        row["set_mean_size"] = float(np.mean([len(m) for m in sets]))
    return row


def repeated_splits(s: dict, manifest, splits: int, seed: int = 0, key: str | None = None) -> dict:
    """Guarantees checked on SciQ test: random halves calibrate (sets; risk threshold behind the artifact's
    gate) and the other halves test. ``key``: which of the manifest's calibrations (default its
    ``calibrated_on``)."""
    calibration = manifest.calibration_for(key or manifest.calibrated_on)
    cal_cfg = calibration.record.get("config", {})
    target = cal_cfg.get("target_accuracy", calibration.thresholds.how.get("target_accuracy", 0.9))
    delta = cal_cfg.get("delta", 0.1)
    alpha = calibration.conformal.alpha if calibration.conformal else 0.1
    set_delta = calibration.conformal.delta if calibration.conformal else None  # None: marginal quantiles
    probs, labels, conf, hits = s["outputs"].probs, s["labels"], s["confidence"], s["hits"]
    limits = calibration.thresholds
    passed = s["outputs"].ood_score() >= limits.ood_threshold  # the artifact's gate, fixed
    scores = {sc: label_scores(probs, labels, sc) for sc in SCORES}
    rng = np.random.default_rng(seed)
    cover = {sc: [] for sc in SCORES}
    size = {sc: [] for sc in SCORES}
    held, answered_share, answered_acc = [], [], []
    n = len(labels)
    for _ in range(splits):
        perm = rng.permutation(n)
        cal, test = perm[: n // 2], perm[n // 2:]
        for sc in SCORES:
            q = conformal_quantile(scores[sc][cal], alpha, set_delta)
            sets = [prediction_set(probs[i], q, sc) for i in test]
            cover[sc].append(np.mean([labels[i] in m for i, m in zip(test, sets, strict=True)]))
            size[sc].append(np.mean([len(m) for m in sets]))
        c = cal[passed[cal]]
        risk = control_accuracy(conf[c], hits[c], target, delta)
        ans = test[passed[test] & (conf[test] >= risk.min_confidence)]
        acc = float(hits[ans].mean()) if len(ans) else 1.0
        held.append(acc >= target)
        answered_share.append(len(ans) / len(test))
        answered_acc.append(acc)
    return {
        "splits": splits, "calibration_size": n // 2, "alpha": alpha, "target_accuracy": target, "delta": delta,
        "set_delta": set_delta,
        "sets": {sc: {"nominal": 1 - alpha, "mean_coverage": float(np.mean(cover[sc])),
                      "share_of_splits_at_least_nominal": float(np.mean(np.asarray(cover[sc]) >= 1 - alpha)),
                      "coverage_p5_p95": [float(np.quantile(cover[sc], 0.05)), float(np.quantile(cover[sc], 0.95))],
                      "mean_size": float(np.mean(size[sc]))} for sc in SCORES},
        "risk": {"share_of_splits_guarantee_held": float(np.mean(held)), "required": 1 - delta,
                 "mean_answered": float(np.mean(answered_share)),
                 "mean_answered_accuracy": float(np.mean(answered_acc))},
    }


def check_manifest(dump: dict, manifest) -> dict:
    """Recalibrate from the dump's SciQ validation stream and compare with the manifest (same code, same seed):
    differences come only from the device's numerics."""
    cal = manifest.calibration
    if not cal.get("config") or cal.get("dataset") != "sciq" or cal.get("split") != "validation" or cal.get("limit"):
        return {"checked": False, "why": "the manifest was not calibrated on all of SciQ validation"}
    cfg = CalibrationConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in cal["config"].items()})
    raw = {**dump["streams"]["sciq_validation"], "offset": dump["offset"]}
    _, _, sections = calibrate_outputs(dump["kind"], raw, raw["labels"], cfg)
    mine, theirs = sections["abstention"], manifest.abstention
    return {"checked": True,
            "min_confidence": [mine["min_confidence"], theirs["min_confidence"]],
            "ood_threshold": [mine["ood_threshold"], theirs["ood_threshold"]]}


def risk_coverage_plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for label, (coverage, risk, point) in curves.items():
        line, = ax.plot(coverage, 1 - risk, label=label)
        ax.plot(*point, "o", color=line.get_color())
    ax.set_xlabel("share answered (coverage), SciQ test")
    ax.set_ylabel("accuracy of answered questions")
    ax.set_title("Risk-coverage on SciQ test (dots: the served operating point)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def analyse(args) -> int:
    result = {"adapters": {}, "command": "python -m benchmarks.decisions analyse " + " ".join(sys.argv[2:])}
    curves = {}
    for spec in args.adapter:
        name, _, directory = spec.partition("=")
        if not directory:
            raise SystemExit(f"--adapter takes NAME=DIR, got {spec!r}")
        manifest = read_manifest(directory)
        dump = load_dump(args.scores_dir, name, manifest)
        streams = {k: served(dump, k, manifest) for k in ("sciq_test", *SHIFTED)}
        rows, dev_rows = {k: stream_row(s, manifest.conformal_sets()) for k, s in streams.items()}, {}
        test = streams["sciq_test"]
        for stream in SHIFTED:
            if stream + "_dev" in dump["streams"]:
                dev_rows[stream] = stream_row(served(dump, stream + "_dev", manifest), manifest.conformal_sets())
        shifted = [rows[k]["answered"] for k in SHIFTED]
        id_metrics = metrics.summarise(test["outputs"].probs, test["labels"], test["outputs"].uncertainty)
        result["adapters"][name] = {
            "artifact": directory, "method": manifest.method, "version": manifest.version,
            "abstention": {k: getattr(manifest.thresholds(), k)
                           for k in ("min_confidence", "ood_score", "ood_threshold")},
            "target_accuracy": manifest.thresholds().how.get("target_accuracy"),
            "streams": rows,
            "max_answered_shifted": float(max(shifted)),
            "dev_streams": dev_rows,
            "sciq_test_metrics": id_metrics,
            "ood_auroc": {k: metrics.auroc(test["outputs"].ood_score(), streams[k]["outputs"].ood_score())
                          for k in SHIFTED},
            "repeated_splits": repeated_splits(test, manifest, args.splits),
            "manifest_check": check_manifest(dump, manifest),
        }
        coverage, risk = metrics.risk_coverage(test["confidence"], test["hits"])
        answered = test["answered"]
        point = (answered.mean(), test["hits"][answered].mean() if answered.any() else np.nan)
        curves[f"{name} ({manifest.method})"] = (coverage, risk, point)
        print(f"{name}: SciQ test answered {rows['sciq_test']['answered']:.3f} at accuracy "
              f"{rows['sciq_test']['answered_accuracy']}; shifted answered at most {max(shifted):.3f}", flush=True)
    out = Path(args.output)
    write_result(out, result, echo=False)
    risk_coverage_plot(curves, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def paired_auroc_difference(a_in, a_out, b_in, b_out, resamples: int = 2000, seed: int = 0) -> dict:
    """AUROC(a_in against a_out) minus AUROC(b_in against b_out), a's and b's scores of the same questions (``_in``:
    in distribution, ``_out``: shifted; each (n,)), with the 2.5/97.5 percentiles of the difference over
    ``resamples`` paired bootstrap draws (the same question indices for both)."""
    a_in, a_out, b_in, b_out = (np.asarray(x, dtype=np.float64) for x in (a_in, a_out, b_in, b_out))
    if a_in.shape != b_in.shape or a_out.shape != b_out.shape:
        raise ValueError(f"the two adapters' scores are not of the same questions: {a_in.shape}/{b_in.shape}, "
                         f"{a_out.shape}/{b_out.shape}")
    rng = np.random.default_rng(seed)
    diffs = []
    for _ in range(resamples):
        i, o = rng.integers(0, len(a_in), len(a_in)), rng.integers(0, len(a_out), len(a_out))
        diffs.append(metrics.auroc(a_in[i], a_out[o]) - metrics.auroc(b_in[i], b_out[o]))
    low, high = np.percentile(diffs, [2.5, 97.5])
    return {"difference": metrics.auroc(a_in, a_out) - metrics.auroc(b_in, b_out), "interval": [low, high],
            "resamples": resamples, "verdict": "cannot tell" if low <= 0 <= high else
            ("a higher" if low > 0 else "b higher")}


def compare(args) -> int:
    adapters = []
    for spec in (args.adapter, args.against):
        name, _, directory = spec.partition("=")
        if not directory:
            raise SystemExit(f"--adapter and --against take NAME=DIR, got {spec!r}")
        manifest = read_manifest(directory)
        dump = load_dump(args.scores_dir, name, manifest)
        adapters.append((name, {k: served(dump, k, manifest) for k in ("sciq_test", *SHIFTED)}))
    (a, sa), (b, sb) = adapters
    for stream in ("sciq_test", *SHIFTED):
        if not np.array_equal(sa[stream]["labels"], sb[stream]["labels"]):
            raise SystemExit(f"{a} and {b} did not answer the same {stream} questions: score them again")
    rows = {}
    for stream in SHIFTED:
        rows[stream] = paired_auroc_difference(
            sa["sciq_test"]["outputs"].ood_score(), sa[stream]["outputs"].ood_score(),
            sb["sciq_test"]["outputs"].ood_score(), sb[stream]["outputs"].ood_score(), args.resamples)
        r = rows[stream]
        print(f"{stream}: {a} minus {b} {100 * r['difference']:+.1f} AUROC points "
              f"[{100 * r['interval'][0]:+.1f}, {100 * r['interval'][1]:+.1f}] ({r['verdict']})")
    write_result(args.output, {"a": a, "b": b, "in_distribution": "sciq_test", "streams": rows,
                               "command": "python -m benchmarks.decisions compare " + " ".join(sys.argv[2:])},
                 echo=False)
    print(f"wrote {args.output}")
    return 0


def choose_rate(args) -> int:
    """The gate's rejection rate chosen on validation data only: calibrate on the dump's SciQ validation
    stream at each candidate rate and keep the smallest rate at which every validation-split shifted stream
    (``<shifted>_dev``) is answered at most ``--max-shifted`` while the calibration part is still answered at
    least ``--min-answered``. The test streams are not read."""
    name, _, directory = args.adapter.partition("=")
    manifest = read_manifest(directory)
    dump = load_dump(args.scores_dir, name, manifest)
    raw = {**dump["streams"]["sciq_validation"], "offset": dump["offset"]}
    missing = [k + "_dev" for k in SHIFTED if k + "_dev" not in dump["streams"]]
    if missing:
        raise SystemExit(f"{name}.json lacks the validation-split streams {missing}: run score with --streams")
    rows, chosen = [], None
    for rate in sorted(float(r) for r in args.rates.split(",")):
        cfg = CalibrationConfig(target_accuracy=args.target_accuracy, delta=args.delta, ood_rejection_rate=rate)
        head_update, _, sections = calibrate_outputs(dump["kind"], raw, raw["labels"], cfg)
        trial = dataclasses.replace(manifest, head={**manifest.head, **head_update}, abstention=sections["abstention"],
                                    conformal=sections["conformal"])
        shifted = {k: stream_row(served(dump, k + "_dev", trial), None)["answered"] for k in SHIFTED}
        row = {"rate": rate, "calibration_part_answered": sections["abstention"]["how"]["coverage"],
               "certified": sections["abstention"]["how"]["certified"], "dev_answered": shifted,
               "max_dev_answered": max(shifted.values())}
        rows.append(row)
        ok = row["certified"] and row["max_dev_answered"] <= args.max_shifted and \
            row["calibration_part_answered"] >= args.min_answered
        print(f"rate {rate:.2f}: calibration part answered {row['calibration_part_answered']:.3f}, "
              f"shifted (dev) answered at most {row['max_dev_answered']:.3f}{'  <- meets both' if ok else ''}")
        if ok and chosen is None:
            chosen = rate
    result = {"adapter": name, "artifact": directory, "max_shifted": args.max_shifted,
              "min_answered": args.min_answered, "rates": rows, "chosen": chosen,
              "command": "python -m benchmarks.decisions choose-rate " + " ".join(sys.argv[2:])}
    write_result(args.output, result, echo=False)
    print(f"chosen rate: {chosen} (wrote {args.output})")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decisions", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("score", help="answer every stream with one adapter (raw outputs) into a JSON dump")
    p.add_argument("--artifact", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--limit", type=int, default=STREAM_LIMIT, help="questions per shifted stream of another dataset")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--device")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--dev-limit", type=int, default=DEV_LIMIT, help="questions per <shifted>_dev stream")
    p.add_argument("--streams", help="comma-separated stream names (default: all)")
    p.add_argument("--resume", action="store_true", help="keep the streams already in --output")
    p.add_argument("--no-progress", action="store_true")
    a = sub.add_parser("analyse", help="apply each artifact's calibration to its dump and write the report")
    a.add_argument("--adapter", action="append", required=True, help="NAME=DIR; the dump is <scores-dir>/NAME.json")
    a.add_argument("--scores-dir", default="benchmarks/results/decision_scores")
    a.add_argument("--splits", type=int, default=200)
    a.add_argument("--output", default="benchmarks/results/decisions.json")
    c = sub.add_parser("choose-rate", help="choose the gate's rejection rate on validation-split streams only")
    c.add_argument("--adapter", required=True, help="NAME=DIR; the dump is <scores-dir>/NAME.json")
    c.add_argument("--scores-dir", default="benchmarks/results/decision_scores")
    c.add_argument("--rates", default="0.05,0.1,0.15,0.2")
    c.add_argument("--max-shifted", type=float, default=0.35, help="most of a shifted stream that may be answered")
    c.add_argument("--min-answered", type=float, default=0.85, help="least of in-distribution questions answered")
    c.add_argument("--target-accuracy", type=float, default=0.9)
    c.add_argument("--delta", type=float, default=CalibrationConfig().delta,
                   help="the calibration's delta, which the gate's training-conditional rank uses (default 0.01)")
    c.add_argument("--output", default="benchmarks/results/decisions_rate_choice.json")
    m = sub.add_parser("compare", help="paired intervals on two adapters' OOD AUROC differences")
    m.add_argument("--adapter", required=True, help="NAME=DIR (a); the dump is <scores-dir>/NAME.json")
    m.add_argument("--against", required=True, help="NAME=DIR (b)")
    m.add_argument("--scores-dir", default="benchmarks/results/decision_scores")
    m.add_argument("--resamples", type=int, default=2000)
    m.add_argument("--output", default="benchmarks/results/decisions_ood_intervals.json")
    args = parser.parse_args(argv)
    if args.command == "compare" and args.resamples < 100:
        parser.error(f"--resamples must be >= 100, got {args.resamples}")
    if args.command == "analyse" and args.splits < 100:
        parser.error(f"--splits must be >= 100, got {args.splits}")
    return {"score": score, "analyse": analyse, "choose-rate": choose_rate, "compare": compare}[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
