"""Labelled feedback replayed: how fast the realised guarantees' alert finds a broken guarantee after a shift, how
often it fires on in-distribution traffic, and what the adaptive sets' coverage does, on the default adapter's
stored outputs (no model run):

    python -m benchmarks.feedback_replay [--artifact artifacts/default] [--seeds 200] \
        [--output benchmarks/results/feedback_replay.json]

The questions' outputs are the ones ``python -m benchmarks.decisions score`` stored
(``benchmarks/results/decision_scores/default.json``), served under the artifact's manifest as the service serves
them (``benchmarks.decisions.served``: post-hoc parameter, OOD gate, risk-controlled threshold, conformal sets).

Per seed:

- *shift*, after a labelled history (``--histories``, 1,000, 10,000 and 100,000 by default): a version that has read
  that many healthy labels (SciQ test questions with passages, in distribution, i.i.d.), then ``--delay`` more
  in-distribution questions, then questions of one shifted stream (SciQ without passages, OBQA, ARC-Easy,
  ARC-Challenge, RACE without its article), each drawn with replacement. Every question is labelled, its label
  arriving ``Uniform{0..--delay}`` questions after its answer, and the labels are read in arrival order (as
  ``POST /v1/feedback`` records them). The alert is the service's (``ibedl.engine.feedback`` with its defaults):
  answered accuracy's confidence-sequence upper bound below the stated 0.9 target (the promise never held since
  the version started) or its change detector's alarm (``ibedl.engine.change_detector``: it stopped holding), and
  likewise for set coverage against its nominal 0.9. Reported: how many labelled answered questions *of the
  shifted stream* had arrived when it fired (and labelled questions for the coverage alert), per history: the
  confidence sequences need more evidence the more history they hold; the detectors do not.
- *in distribution*: SciQ test alone until 2,000 labelled answered questions: does either alert ever fire?
- *healthy deployments* (``--draws``, default 200): what the alert's false-alarm rate is over calibration draws,
  as a guarantee stated with a calibration delta must be tested. The population is the stored in-distribution
  outputs (SciQ validation and test, 2,000 questions); each draw calibrates afresh, as
  ``python -m ibedl.training.calibrate`` does with the artifact's settings, on ``--calibration-size`` questions
  drawn from it (i.i.d., with replacement), then serves ``--labels`` (100,000) more i.i.d. labelled questions from
  it through that draw's own rule. Reported per guarantee: the share of draws whose served rule misses its stated
  level on the population (at most the calibration's delta in expectation), and the share whose alert ever fires;
  for either guarantee against the documented bound 2 x (delta + alpha/2) + the change detectors' false-alarm
  probability (IBEDL_CHANGE_FALSE_ALARM within IBEDL_CHANGE_HORIZON labels).
- the adaptive sets (``ibedl.engine.adaptive``, rate ``--rate``) follow the same delayed labels; their coverage
  and size before and after the shift beside the calibrated sets'.

``--service`` runs the loop once end to end through the real service instead (``python -m ibedl.serve`` on the
artifact, CPU): ``--service-before`` SciQ test questions with their passages, then ``--service-after`` ARC-Challenge
test questions, answered by ``POST /predict/batch`` 8 at a time, each batch's labels sent back by
``POST /v1/feedback/batch`` after the next batch is answered (a one-batch delay), ``GET /v1/guarantees`` read after
every label batch (default output ``benchmarks/results/feedback_service.json``).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

from benchmarks.common import write_result
from benchmarks.decisions import load_dump, served
from ibedl.core.artifact import read_manifest
from ibedl.core.conformal import option_scores
from ibedl.core.paths import check_writable
from ibedl.engine.adaptive import QuantileTracker
from ibedl.engine.change_detector import ChangeDetector, alarm_threshold
from ibedl.engine.confidence_sequence import BettingCS
from ibedl.engine.feedback import WATCHED
from ibedl.engine.settings import EngineSettings
from ibedl.training.calibrate import CalibrationConfig, calibrate_outputs, posthoc_outputs

SHIFTS = ("sciq_no_passage", "obqa", "arc_easy", "arc_challenge", "race_no_article")
IN_DISTRIBUTION = "sciq_test"
HEALTHY_POOL = ("sciq_validation", "sciq_test")  # the in-distribution population of the healthy draws
ALPHA = EngineSettings.model_fields["guarantee_alpha"].default  # IBEDL_GUARANTEE_ALPHA's default
CHANGE_FALSE_ALARM = EngineSettings.model_fields["change_false_alarm"].default  # IBEDL_CHANGE_FALSE_ALARM's
CHANGE_HORIZON = EngineSettings.model_fields["change_horizon"].default  # IBEDL_CHANGE_HORIZON's
THRESHOLD = alarm_threshold(CHANGE_HORIZON, CHANGE_FALSE_ALARM, len(WATCHED))  # the service's detectors' threshold

FALSE_ALARM_ANSWERED = 2000
CAP_ANSWERED = 400  # labelled answered shifted questions replayed at most (the alert may not have fired by then)


def stream_arrays(s: dict, conformal) -> dict:
    """Per question of a served stream: answered, correct, covered by the calibrated set, and the option scores
    with the label's index (what an adaptive set needs)."""
    q = np.asarray([conformal.for_options(len(p)).quantile() for p in s["outputs"].probs])  # per count, as served
    scores = [option_scores(p, conformal.score) for p in s["outputs"].probs]
    top = [int(np.argmax(p)) for p in s["outputs"].probs]
    labels = [int(y) for y in s["labels"]]
    return {
        "answered": np.asarray(s["answered"], dtype=bool),
        "correct": np.asarray(s["hits"], dtype=bool),
        "covered": np.asarray([sc[y] <= qi + 1e-9 or y == t
                               for sc, y, t, qi in zip(scores, labels, top, q, strict=True)]),
        "size": np.asarray([max(1, int(np.sum(sc <= qi + 1e-9))) for sc, qi in zip(scores, q, strict=True)]),
        "label_score": np.asarray([sc[y] for sc, y in zip(scores, labels, strict=True)]),
        "label_is_top": np.asarray([y == t for y, t in zip(labels, top, strict=True)]),
        "scores": scores,
    }


def draw(arrays: dict, idx: np.ndarray) -> dict:
    return {k: (v[idx] if isinstance(v, np.ndarray) else [v[i] for i in idx]) for k, v in arrays.items()}


def replay_seed(rng, before: dict, after: dict | None, n_before: int, n_after: int, delay: int, quantile: float,
                rate: float, target_cov: float) -> dict:
    """One seed's question sequence: ``n_before`` questions of ``before`` then ``n_after`` of ``after`` (None: none),
    with labels arriving ``Uniform{0..delay}`` questions after each answer. Returns the label-arrival-ordered
    outcomes, and the adaptive sets' coverage and size per question (sets built with the threshold of the labels
    that had arrived)."""
    first = draw(before, rng.integers(0, len(before["answered"]), n_before))
    parts = [first]
    if after is not None:
        parts.append(draw(after, rng.integers(0, len(after["answered"]), n_after)))
    seq = {k: (np.concatenate([p[k] for p in parts]) if isinstance(first[k], np.ndarray)
               else sum((p[k] for p in parts), [])) for k in first}
    n = len(seq["answered"])
    shifted = np.arange(n) >= n_before
    arrival = np.arange(n) + rng.integers(0, delay + 1, n)
    order = np.argsort(arrival, kind="stable")  # labels in the order they arrive

    # adaptive sets: question t is answered with the threshold of the labels arrived before it; the threshold counts
    # the rule's set (a miss when it is empty), the answer shows the top option alone then (ibedl.engine.adaptive)
    tracker = QuantileTracker(quantile, 1.0 - target_cov, rate)
    adaptive_cov = np.zeros(n, dtype=bool)  # the shown set held the label
    counted = np.zeros(n, dtype=bool)  # the rule's set held it
    adaptive_size = np.zeros(n, dtype=np.int64)
    pointer = 0
    for t in range(n):
        while pointer < n and arrival[order[pointer]] < t:
            tracker.update(bool(counted[order[pointer]]))
            pointer += 1
        q = tracker.quantile
        inside = int(np.sum(seq["scores"][t] <= q + 1e-9))
        counted[t] = seq["label_score"][t] <= q + 1e-9
        adaptive_cov[t] = counted[t] or (inside == 0 and seq["label_is_top"][t])
        adaptive_size[t] = max(1, inside)
    return {"answered": seq["answered"][order], "correct": seq["correct"][order], "covered": seq["covered"][order],
            "shifted": shifted[order], "adaptive_covered": adaptive_cov, "adaptive_size": adaptive_size,
            "covered_static": seq["covered"], "size_static": seq["size"], "shifted_by_question": shifted}


class Watch:
    """What the service watches for one stated guarantee, over a batch of seeds: its confidence sequence (did the
    promise hold since the version started) and its change detector (did it stop holding), as
    ibedl.engine.feedback keeps them, with the service's defaults."""

    def __init__(self, stated: float, seeds: int) -> None:
        self.stated = stated
        self.cs = BettingCS(ALPHA, (seeds,))
        self.detector = ChangeDetector(stated, THRESHOLD, (seeds,))

    def update(self, x, active) -> None:
        self.cs.update(x, active=active)
        self.detector.update(x, active=active)

    def fired(self) -> tuple[np.ndarray, np.ndarray]:
        """(the sequence's upper bound below the stated level, the detector alarmed), each (seeds,) bool."""
        return self.cs.below_target(self.stated), self.detector.alarmed()


def history(rng, base: dict, labels: int, seeds: int, target_acc: float, target_cov: float) -> dict:
    """The watches of every seed after ``labels`` healthy labelled questions of ``base`` (i.i.d., in order), and
    which seeds alarmed during them."""
    watches = {"acc": Watch(target_acc, seeds), "cov": Watch(target_cov, seeds)}
    alarmed = np.zeros(seeds, dtype=bool)
    for _ in range(labels):
        i = rng.integers(0, len(base["answered"]), seeds)
        watches["acc"].update(base["correct"][i], active=base["answered"][i])
        watches["cov"].update(base["covered"][i], active=np.ones(seeds, dtype=bool))
        for w in watches.values():
            cs, detector = w.fired()
            alarmed |= cs | detector
    return {"watches": watches, "alarmed": alarmed}


def first_alarms(runs: list[dict], target_acc: float, target_cov: float, start: dict | None = None) -> dict:
    """Replay every seed's labels (in arrival order) through the service's confidence sequences and change
    detectors, all seeds at once, from ``start`` (:func:`history`'s watches after a labelled history; None: a new
    version); per seed, at the first accuracy alarm and the first coverage alarm (either test): the labelled
    answered shifted questions and labelled shifted questions arrived so far (-1: never), and which test fired
    first (``*_by_detector``)."""
    import copy

    seeds = len(runs)
    length = max(len(r["answered"]) for r in runs)
    pad = lambda key: np.stack([np.pad(r[key], (0, length - len(r[key]))) for r in runs])  # noqa: E731
    answered, correct, covered, shifted = pad("answered"), pad("correct"), pad("covered"), pad("shifted")
    present = np.stack([np.arange(length) < len(r["answered"]) for r in runs])
    watches = copy.deepcopy(start["watches"]) if start else {"acc": Watch(target_acc, seeds),
                                                             "cov": Watch(target_cov, seeds)}
    out = {k: np.full(seeds, -1) for k in ("acc_answered", "acc_labels", "cov_answered", "cov_labels",
                                            "acc_before_shift", "cov_before_shift")}
    by_detector = {"acc": np.zeros(seeds, dtype=bool), "cov": np.zeros(seeds, dtype=bool)}
    answered_shifted = np.zeros(seeds, dtype=np.int64)
    labels_shifted = np.zeros(seeds, dtype=np.int64)
    for k in range(length):
        on = present[:, k]
        watches["acc"].update(correct[:, k], active=on & answered[:, k])
        watches["cov"].update(covered[:, k], active=on)
        answered_shifted += on & answered[:, k] & shifted[:, k]
        labels_shifted += on & shifted[:, k]
        for name, watch in watches.items():
            cs, detector = watch.fired()
            fired = (cs | detector) & (out[f"{name}_answered"] < 0) & (out[f"{name}_before_shift"] < 0)
            before = fired & (labels_shifted == 0)
            out[f"{name}_before_shift"][before] = k
            after = fired & ~before
            out[f"{name}_answered"][after] = answered_shifted[after]
            out[f"{name}_labels"][after] = labels_shifted[after]
            by_detector[name][after] = detector[after] & ~cs[after]
    out["acc_by_detector"], out["cov_by_detector"] = by_detector["acc"], by_detector["cov"]
    return out


def summary(values: np.ndarray, within: int | None = None) -> dict:
    fired = values[values >= 0]
    row = {"fired": float(np.mean(values >= 0)),
           "median": float(np.median(fired)) if len(fired) else None,
           "p90": float(np.percentile(fired, 90)) if len(fired) else None,
           "max": int(fired.max()) if len(fired) else None}
    if within is not None:
        row[f"within_{within}"] = float(np.mean((values >= 0) & (values <= within)))
    return row


def set_phase(runs: list[dict], lo: int, hi: int) -> dict:
    """Mean coverage and size of the calibrated and the adaptive sets over questions lo..hi-1 of every seed."""
    pick = lambda key: np.concatenate([r[key][lo:hi] for r in runs])  # noqa: E731
    return {"calibrated_coverage": float(pick("covered_static").mean()),
            "calibrated_size": float(pick("size_static").mean()),
            "adaptive_coverage": float(pick("adaptive_covered").mean()),
            "adaptive_size": float(pick("adaptive_size").mean())}


def coverage_rows(runs: list[dict], n_before: int) -> dict:
    """The sets before the shift, over its first 300 questions and over the next 1,700."""
    return {"in_distribution": set_phase(runs, 0, n_before),
            "first_300_after_shift": set_phase(runs, n_before, n_before + 300),
            "300_to_2000_after_shift": set_phase(runs, n_before + 300, n_before + 2000)}


def healthy_draws(args, dump: dict, manifest) -> dict:
    """False alarms over calibration draws: each draw calibrates on its own i.i.d. sample of the in-distribution
    population and then streams i.i.d. labels through its own served rule (see the module docstring)."""
    from ibedl.core.artifact import Abstention, Conformal
    from ibedl.core.conformal import prediction_set
    from ibedl.engine.abstention import decide

    stored = manifest.calibration.get("config", {})
    config = CalibrationConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in stored.items()})
    pool = {"labels": [], "probs": [], "alpha": [], "sigma": []}
    for name in HEALTHY_POOL:
        stream = dump["streams"][name]
        for key in pool:
            pool[key] += list(stream[key]) if stream.get(key) is not None else []
    for key in ("alpha", "sigma"):
        if not pool[key]:
            pool[key] = None
    labels, n = np.asarray(pool["labels"]), len(pool["labels"])
    raw = {**{k: v for k, v in pool.items() if k != "labels"}, "offset": dump["offset"]}
    pick = lambda idx: {k: (None if v is None else [v[i] for i in idx]) if isinstance(v, list) or v is None  # noqa: E731
                        else v for k, v in raw.items()}
    rng = np.random.default_rng(1)
    answered = np.zeros((args.draws, n), dtype=bool)
    correct = np.zeros((args.draws, n), dtype=bool)
    covered = np.zeros((args.draws, n), dtype=bool)
    targets, nominals, deltas = set(), set(), set()
    for d in range(args.draws):
        idx = rng.integers(0, n, args.calibration_size)
        head_update, _, sections = calibrate_outputs(dump["kind"], pick(idx), labels[idx], config)
        limits, conformal = Abstention(**sections["abstention"]), Conformal(**sections["conformal"])
        outputs = posthoc_outputs(dump["kind"], raw, head_update)
        u, conf = outputs.uncertainty, outputs.confidence
        answered[d] = [decide(None if u is None else float(u[i]), float(conf[i]), limits) is None for i in range(n)]
        correct[d] = [int(np.argmax(p)) == y for p, y in zip(outputs.probs, labels, strict=True)]
        q = conformal.quantile()
        covered[d] = [int(y) in prediction_set(p, q, conformal.score) for p, y in zip(outputs.probs, labels,
                                                                                           strict=True)]
        targets.add(float(limits.how["target_accuracy"])), nominals.add(round(1.0 - conformal.alpha, 6))
        deltas.add(conformal.delta), deltas.add(limits.how["delta"])
    (target,), (nominal,), (delta,) = targets, nominals, deltas
    # the served rules' own levels on the population
    level_acc = (correct & answered).sum(1) / np.maximum(answered.sum(1), 1)
    level_cov = covered.mean(1)
    traffic = rng.integers(0, n, (args.draws, args.labels))
    rows = np.arange(args.draws)[:, None]
    t_answered, t_correct, t_covered = answered[rows, traffic], correct[rows, traffic], covered[rows, traffic]
    accuracy, coverage = Watch(target, args.draws), Watch(nominal, args.draws)
    fired_acc = np.full(args.draws, -1)
    fired_cov = np.full(args.draws, -1)
    by = {"acc": np.zeros(args.draws, dtype=bool), "cov": np.zeros(args.draws, dtype=bool)}
    for k in range(args.labels):
        accuracy.update(t_correct[:, k], active=t_answered[:, k])
        coverage.update(t_covered[:, k], active=np.ones(args.draws, dtype=bool))
        for name, watch, fired in (("acc", accuracy, fired_acc), ("cov", coverage, fired_cov)):
            cs, detector = watch.fired()
            new = (fired < 0) & (cs | detector)
            fired[new] = k
            by[name][new] = detector[new] & ~cs[new]
    # per version: each guarantee's sequence (alpha / 2), its served rule missing its level (delta), and the change
    # detectors of both guarantees together (IBEDL_CHANGE_FALSE_ALARM within IBEDL_CHANGE_HORIZON labels, growing
    # linearly beyond)
    change = CHANGE_FALSE_ALARM * max(1.0, args.labels / CHANGE_HORIZON)
    bound = 2 * (delta + ALPHA / 2) + change
    either = (fired_acc >= 0) | (fired_cov >= 0)
    return {
        "draws": args.draws, "calibration_size": args.calibration_size, "labels": args.labels,
        "population": f"{' + '.join(HEALTHY_POOL)} stored outputs ({n} questions)",
        "calibration_config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(config).items()},
        "delta": delta, "guarantee_alpha": ALPHA, "target_accuracy": target, "nominal_coverage": nominal,
        "answered_accuracy": {"rule_below_target_on_population": float(np.mean(level_acc < target)),
                              "population_level_mean": float(level_acc.mean()),
                              "population_level_p5": float(np.percentile(level_acc, 5)),
                              "answered_share_mean": float(answered.mean()),
                              "false_alarm": float(np.mean(fired_acc >= 0)),
                              "false_alarm_by_detector": float(np.mean(by["acc"])), "bound": delta + ALPHA / 2},
        "set_coverage": {"rule_below_nominal_on_population": float(np.mean(level_cov < nominal)),
                         "population_level_mean": float(level_cov.mean()),
                         "population_level_p5": float(np.percentile(level_cov, 5)),
                         "false_alarm": float(np.mean(fired_cov >= 0)),
                         "false_alarm_by_detector": float(np.mean(by["cov"])), "bound": delta + ALPHA / 2},
        "change_detectors": {"false_alarm": CHANGE_FALSE_ALARM, "horizon": CHANGE_HORIZON, "threshold": THRESHOLD,
                             "bound_at_these_labels": change},
        "false_alarm_any": float(either.mean()),
        "documented_bound": bound,
        "met": bool(either.mean() <= min(bound, 0.05)),
    }


def service_run(args) -> dict:
    """The loop once through the real service: answers, receipts, delayed labels, the guarantees as served."""
    import tempfile

    import httpx

    from benchmarks.service_process import ServiceProcess
    from ibedl.training.data import load_dataset

    def as_body(q, context: bool) -> dict:
        return {"question": q.question, "options": list(q.options), "id": q.id,
                **({"context": q.context} if context and q.context else {})}

    before = [(as_body(q, True), q.answer, False)
              for q in load_dataset("sciq", "test", limit=args.service_before, seed=1)]
    after = [(as_body(q, False), q.answer, True)
             for q in load_dataset("arc_challenge", "test", limit=args.service_after, seed=1)]
    stream = before + after
    with tempfile.TemporaryDirectory() as tmp:
        env = {"IBEDL_FEEDBACK_KEY": "feedback-replay-service-key",
               "IBEDL_FEEDBACK_DB": str(Path(tmp) / "feedback.sqlite"), "IBEDL_ADAPTIVE_SETS": "true",
               "IBEDL_DEVICE": "cpu", "IBEDL_THREADS": "1", "IBEDL_REQUEST_TIMEOUT_S": "120"}
        service = ServiceProcess(args.artifact, env=env, log_path=Path(tmp) / "service.log")
        try:
            service.wait_ready(600)
            http = httpx.Client(base_url=service.url, timeout=300, trust_env=False)
            pending: list[dict] = []
            trace, first_violation = [], {}
            answered_shifted = labelled_shifted = 0
            for start in range(0, len(stream) + 8, 8):
                chunk = stream[start:start + 8]
                answers = []
                if chunk:
                    r = http.post("/predict/batch", json={"items": [body for body, _, _ in chunk]})
                    r.raise_for_status()
                    answers = r.json()["results"]
                if pending:  # the previous batch's labels arrive now
                    r = http.post("/v1/feedback/batch", json={"items": [
                        {"receipt": p["receipt"], "label": p["label"]} for p in pending]})
                    r.raise_for_status()
                    labelled_shifted += sum(p["shifted"] for p in pending)
                    answered_shifted += sum(p["shifted"] and not p["abstained"] for p in pending)
                    found = http.get("/v1/guarantees").json()["guarantees"]
                    state = {f"{g['guarantee']}@{g['stated']}": g for g in found}
                    trace.append({"labels": start, "labelled_shifted": labelled_shifted,
                                  "answered_shifted": answered_shifted,
                                  **{k: {"labels": g["labels"], "estimate": g["estimate"], "lower": g["lower"],
                                         "upper": g["upper"], "violated": g["violated"]} for k, g in state.items()}})
                    for key, g in state.items():
                        if g["violated"] and key not in first_violation:
                            first_violation[key] = {"labelled_shifted": labelled_shifted,
                                                    "labelled_answered_shifted": answered_shifted,
                                                    "upper": g["upper"], "labels": g["labels"]}
                pending = [{"receipt": a["receipt"], "label": "ABCDEFGHIJ"[answer], "shifted": shifted,
                            "abstained": a["abstained"]}
                           for a, (_, answer, shifted) in zip(answers, chunk, strict=True)]
            final = http.get("/v1/guarantees").json()
            metrics = http.get("/metrics").text
        finally:
            service.stop()
    return {"artifact": args.artifact, "questions_before_shift": len(before), "shifted_stream": "arc_challenge",
            "questions_after_shift": len(after), "label_delay": "one batch of 8",
            "first_violation": first_violation, "final": final,
            "metrics_guarantee_upper": [line for line in metrics.splitlines()
                                        if line.startswith("ibedl_guarantee_upper")],
            "trace": trace}


def parse_counts_list(text: str) -> list[int]:
    """``1000,10000`` -> [1000, 10000]: each >= 1."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.feedback_replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", default="artifacts/default")
    parser.add_argument("--scores-dir", default="benchmarks/results/decision_scores")
    parser.add_argument("--name", default="default", help="the stored outputs <scores-dir>/<name>.json")
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--histories", type=parse_counts_list, default=[1000, 10_000, 100_000],
                        help="healthy labelled questions a version has read before the shift, one replay each "
                        "(default 1000,10000,100000)")
    parser.add_argument("--delay", type=int, default=200, help="labels arrive up to this many questions late")
    parser.add_argument("--rate", type=float, default=0.01, help="the adaptive sets' step (IBEDL_ADAPTIVE_RATE)")
    parser.add_argument("--output", help="default benchmarks/results/feedback_replay.json "
                        "(feedback_service.json with --service)")
    parser.add_argument("--draws", type=positive, default=200, help="healthy deployments: calibration draws")
    parser.add_argument("--calibration-size", type=positive, default=1000,
                        help="healthy deployments: questions each draw calibrates on")
    parser.add_argument("--labels", type=positive, default=100_000,
                        help="healthy deployments: labels streamed per draw")
    parser.add_argument("--only-healthy", action="store_true", help="run the healthy deployments only")
    parser.add_argument("--service", action="store_true", help="run the loop once through the real service instead")
    parser.add_argument("--service-before", type=int, default=48, help="SciQ test questions before the shift")
    parser.add_argument("--service-after", type=int, default=160, help="ARC-Challenge questions after it")
    args = parser.parse_args(argv)
    args.output = args.output or f"benchmarks/results/feedback_{'service' if args.service else 'replay'}.json"
    try:  # refused before the work, not after it
        check_writable(args.output, "--output")
        manifest = read_manifest(Path(args.artifact))
    except ValueError as e:  # ArtifactError too
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.service:
        write_result(args.output, service_run(args))
        return 0
    if args.seeds < 1 or args.delay < 0 or not args.rate > 0:
        parser.error(f"--seeds must be >= 1, --delay >= 0, --rate > 0; got {args.seeds}, {args.delay}, {args.rate}")
    if not (Path(args.scores_dir) / f"{args.name}.json").is_file():
        stored = Path(args.scores_dir) / f"{args.name}.json"
        print(f"error: no stored outputs {stored}: python -m benchmarks.decisions score --artifact {args.artifact} "
              "--output that file first", file=sys.stderr)
        return 2
    dump = load_dump(args.scores_dir, args.name, manifest)
    conformal = manifest.conformal_sets()
    target_acc = float(manifest.thresholds().how["target_accuracy"])
    target_cov = round(1.0 - conformal.alpha, 6)
    streams = {name: stream_arrays(served(dump, name, manifest), conformal) for name in (IN_DISTRIBUTION, *SHIFTS)}
    base = streams[IN_DISTRIBUTION]
    rng = np.random.default_rng(0)
    healthy = healthy_draws(args, dump, manifest)
    print(f"healthy deployments: {healthy}", file=sys.stderr)
    if args.only_healthy:
        write_result(args.output, {"artifact": args.artifact, "version": str(manifest.version),
                                   "outputs": f"{args.scores_dir}/{args.name}.json", "healthy_deployments": healthy})
        return 0

    result = {
        "artifact": args.artifact, "version": str(manifest.version), "outputs": f"{args.scores_dir}/{args.name}.json",
        "seeds": args.seeds, "alpha": ALPHA, "target_accuracy": target_acc, "nominal_coverage": target_cov,
        "histories": args.histories, "label_delay_max": args.delay, "adaptive_rate": args.rate,
        "change_detectors": {"false_alarm": CHANGE_FALSE_ALARM, "horizon": CHANGE_HORIZON, "threshold": THRESHOLD},
        "streams": {name: {"questions": int(len(a["answered"])), "answered": float(a["answered"].mean()),
                           "answered_accuracy": float(a["correct"][a["answered"]].mean()),
                           "set_coverage": float(a["covered"].mean())} for name, a in streams.items()},
    }

    # in distribution: 2,000 labelled answered questions
    n_id = math.ceil(FALSE_ALARM_ANSWERED / base["answered"].mean() * 1.05) + args.delay
    runs = [replay_seed(rng, base, None, n_id, 0, args.delay, conformal.quantile(), args.rate, target_cov)
            for _ in range(args.seeds)]
    for r in runs:  # cut each seed at its 2,000th labelled answered question
        cut = int(np.searchsorted(np.cumsum(r["answered"]), FALSE_ALARM_ANSWERED)) + 1
        for key in ("answered", "correct", "covered", "shifted"):
            r[key] = r[key][:cut]
    alarms = first_alarms(runs, target_acc, target_cov)
    acc, cov = alarms["acc_before_shift"] >= 0, alarms["cov_before_shift"] >= 0
    result["in_distribution"] = {
        "labelled_answered": FALSE_ALARM_ANSWERED,
        "false_alarm_accuracy": float(acc.mean()), "false_alarm_coverage": float(cov.mean()),
        "false_alarm_any": float((acc | cov).mean()),
        "sets": set_phase(runs, 0, n_id),
    }
    print(f"in distribution: false alarms {result['in_distribution']}", file=sys.stderr)

    result["healthy_deployments"] = healthy
    result["histories"] = {}
    for labelled in args.histories:
        # a version that has read `labelled` healthy labels (i.i.d., in order), then --delay more in-distribution
        # questions whose labels mix, in arrival order, with those of the shifted stream that follows
        past = history(rng, base, labelled, args.seeds, target_acc, target_cov)
        rows = {"alarm_during_history": float(past["alarmed"].mean()), "shifts": {}}
        for name in SHIFTS:
            after = streams[name]
            n_after = math.ceil(CAP_ANSWERED / max(after["answered"].mean(), 1e-3)) + args.delay
            runs = [replay_seed(rng, base, after, args.delay, n_after, args.delay, conformal.quantile(), args.rate,
                                target_cov) for _ in range(args.seeds)]
            alarms = first_alarms(runs, target_acc, target_cov, start=past)
            either = np.where((alarms["acc_answered"] >= 0) & (alarms["cov_answered"] >= 0),
                              np.minimum(alarms["acc_answered"], alarms["cov_answered"]),
                              np.maximum(alarms["acc_answered"], alarms["cov_answered"]))
            rows["shifts"][name] = {
                "answered_accuracy": result["streams"][name]["answered_accuracy"],
                "alarm_before_shift": float(np.mean((alarms["acc_before_shift"] >= 0)
                                                    | (alarms["cov_before_shift"] >= 0) | past["alarmed"])),
                "accuracy_alert_labelled_answered": summary(alarms["acc_answered"], 300),
                "accuracy_alert_first_by_detector": float(np.mean(alarms["acc_by_detector"])),
                "coverage_alert_labelled": summary(alarms["cov_labels"]),
                "coverage_alert_labelled_answered": summary(alarms["cov_answered"], 300),
                "either_alert_labelled_answered": summary(either, 300),
                **({"sets": coverage_rows(runs, args.delay)} if labelled == args.histories[0] else {}),
            }
            print(f"history {labelled}, {name}: {rows['shifts'][name]}", file=sys.stderr, flush=True)
        result["histories"][str(labelled)] = rows

    low = [n for n in SHIFTS if result["streams"][n]["answered_accuracy"] <= 0.6]
    result["done_when"] = {
        "healthy_false_alarm_any_at_most_documented_and_5pct": healthy["met"],
        "false_alarm_accuracy_at_most_5pct": result["in_distribution"]["false_alarm_accuracy"] <= 0.05,
        "false_alarm_any_at_most_5pct": result["in_distribution"]["false_alarm_any"] <= 0.05,
        "shifts_at_most_60pct_accuracy": low,
        "accuracy_alert_within_300_in_90pct": {
            h: {n: rows["shifts"][n]["accuracy_alert_labelled_answered"]["within_300"] >= 0.9 for n in low}
            for h, rows in result["histories"].items()},
    }
    result["done_when"]["met"] = bool(
        result["done_when"]["healthy_false_alarm_any_at_most_documented_and_5pct"]
        and result["done_when"]["false_alarm_any_at_most_5pct"]
        and all(all(v.values()) for v in result["done_when"]["accuracy_alert_within_300_in_90pct"].values()))
    write_result(args.output, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
