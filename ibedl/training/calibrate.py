"""Calibrate an adapter's decisions on labelled data, without retraining: the post-hoc step (zeta for IB-EDL,
temperature for softmax methods), the out-of-distribution gate, risk-controlled abstention, conformal
prediction sets and the drift reference. Training calls the same code on its validation split.

    python -m ibedl.training.calibrate --artifact artifacts/default --dataset sciq --split validation \
        [--output DIR] [--target-accuracy 0.9] [--delta 0.1] [--alpha 0.1] [--ood-rejection-rate 0.05]

The labelled sample is split once (seeded) in two parts:

- the *fit* part (``--fit-fraction``, 30%) fits the post-hoc parameter and the gate threshold;
- the *calibration* part (the rest) chooses the risk-controlled confidence threshold (ibedl.training.risk_control)
  and the conformal quantiles (ibedl.core.conformal), so that their guarantees rest on data that chose
  nothing else.

``--save-outputs FILE`` keeps the model's raw outputs, and ``--outputs FILE`` recalibrates from them (other
targets, rates or seeds) without running the model again.

``--backend NAME`` (ibedl.core.backends) runs the model on that inference backend and records the calibration as
made on it: a guarantee holds for the weights and the arithmetic that ran them. The manifest keeps one calibration
per backend and precision (``calibrated_on`` at the top level, the others in ``backend_calibrations``); the service
serves the one matching its backend. Replacing a calibration the artifact carries writes a new ``version`` (the
answers served on that backend change, and their labels are counted apart); adding one for a backend it never carried,
on questions from the same source, leaves the version and every other calibration as they were.

The calibrations an artifact carries describe one source of questions: a calibration on questions from another one
(your own JSONL file after SciQ's) drops the other backends' calibrations made on the old source, since they would
go on promising what held for other questions (``auto`` serves only backends it carries a calibration for, so it
serves the recalibrated one until the others are calibrated on the new source: the command prints each one's line,
this run's with its ``--backend``; after a run on stored outputs, that backend's arguments). A source is a built-in
dataset's split (whatever subset ``--limit`` draws) or a JSONL file's content; one unknown (a record written by
training, stored outputs without their file) drops nothing. The top-level calibration cannot be dropped; when it is
stale the command says so, with its line. A drop, like a replacement, writes a new ``version``. ``--dataset
feedback`` drops nothing: its labels are the answering backend's alone.

On a GPU, each arithmetic ``auto`` may serve there is calibrated on its own outputs: ``--device cuda`` (bfloat16:
``torch-cuda-bf16``), ``--device cuda --dtype float32`` (``torch-cuda-fp32``), ``--device cuda --load-in-4bit`` (NF4
weights, bitsandbytes: ``torch-cuda-nf4-bf16``); ``--backend torch-cuda-nf4-bf16`` (and the others) computes the same
arithmetic whatever ``--dtype`` loads. The adapter folded into the weights (half the operations a forward dispatches)
is an arithmetic of its own, only a backend computes: ``--backend torch-cuda-merged-bf16`` or
``torch-cuda-merged-fp32`` with ``--device cuda``; so is that merged trunk replayed from CUDA graphs (one launch a
pass): ``--backend torch-cuda-graphs-bf16`` or ``torch-cuda-graphs-fp32``.

``--dataset feedback --path FEEDBACK_DB`` calibrates on production traffic: the labels sent back to the service
(``POST /v1/feedback``) for this adapter version, with the outputs its receipts carried, so the model does not run
again. Those outputs are what the service answered, after the served post-hoc parameter, so that parameter is kept
(no post-hoc refit) and the gate, the risk-controlled threshold, the prediction sets and the drift reference are
chosen on the labelled traffic.

Without ``--output`` the artifact is updated in place; with it, a new artifact directory is written whose
adapter and head weights are hard links to (or, across file systems, copies of) the original's. That directory must
not exist yet or be empty, or hold an earlier calibration of the same weights (it gets a version past both), or be
``--artifact`` itself (in place): one that holds other files, another artifact say, is refused before the model runs,
as its files would be replaced.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import re
import shlex
import shutil
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from ibedl.core import arithmetic, quantization_sample
from ibedl.core.artifact import Abstention, Conformal, Manifest, check_artifact, read_manifest, write_manifest
from ibedl.core.backends import BACKENDS, calibration_key, get, of_key
from ibedl.core.base_model import check_device, sha256_file
from ibedl.core.conformal import SCORES, alpha_key, calibrate_quantiles, conformal_rank, prediction_set
from ibedl.core.cpu_isa import int8_isa
from ibedl.core.head import POSTHOC_NEUTRAL
from ibedl.core.model_card import write_card
from ibedl.core.paths import check_writable
from ibedl.core.prompt import MAX_OPTIONS, MIN_OPTIONS, MCQuestion
from ibedl.engine.feedback_kinds import is_dsn, open_store_at
from ibedl.training import metrics
from ibedl.training.data.option_counts import parse_counts, vary_option_counts
from ibedl.training.head_kinds import Outputs, head_kind, served_kind
from ibedl.training.risk_control import control_accuracy

log = logging.getLogger("ibedl.training.calibrate")

ALPHAS = (0.01, 0.02, 0.05, 0.1, 0.2)  # conformal levels stored for requests to choose from
# Questions an option count needs in the sample (fit and calibration parts together) for the calibration to claim it:
# with fewer, answers with that count say that no promise holds (CalibrationConfig.min_per_count, --min-per-count).
MIN_PER_COUNT = 200


@dataclass
class CalibrationConfig:
    """What to calibrate for.

    Attributes:
        target_accuracy: accuracy guaranteed on answered in-distribution questions.
        delta: probability that a guarantee may fail over the draw of the calibration sample, for the answer
            threshold (Learn-Then-Test) and the prediction sets (training-conditional quantiles) alike: with
            probability >= 1 - delta, the served threshold's answered accuracy is >= target_accuracy, and with
            probability >= 1 - delta the served sets' coverage is >= 1 - alpha.
        alpha: default miscoverage of the served prediction sets (one of ``alphas``).
        alphas: conformal levels stored; a request may pick any of them.
        score: default conformal score, ``lac`` or ``aps``.
        ood_rejection_rate: share of in-distribution questions the gate may refuse (its threshold is that
            conformal quantile of the fit part's OOD scores; 0 turns the gate off).
        fit_fraction: share of the labelled sample that fits the post-hoc parameter and the gate.
        seed: seed of the split.
        posthoc: refit zeta (IB-EDL) or the temperature (softmax methods).
        reference_size: drift reference values kept in the manifest.
        main_options: in a sample calibrated per option count, the count the top level (what a count never calibrated
            falls back to, the model card's summary) and the drift reference are for: the traffic's usual count.
            Default: the count with the most questions (ties: the smallest).
        min_per_count: questions an option count needs in the sample for the calibration to claim it (each claimed
            count is calibrated on its own questions); a count with fewer is answered with ``holds: false``.
    """

    target_accuracy: float = 0.9
    delta: float = 0.01
    alpha: float = 0.1
    alphas: tuple[float, ...] = ALPHAS
    score: str = "lac"
    ood_rejection_rate: float = 0.05
    fit_fraction: float = 0.3
    seed: int = 0
    posthoc: bool = True
    reference_size: int = 1000
    main_options: int | None = None
    min_per_count: int = MIN_PER_COUNT

    def __post_init__(self) -> None:
        if self.main_options is not None and (isinstance(self.main_options, bool) or not isinstance(
                self.main_options, int) or not MIN_OPTIONS <= self.main_options <= MAX_OPTIONS):
            raise ValueError(f"main_options must be an option count in {MIN_OPTIONS}..{MAX_OPTIONS}, "
                             f"got {self.main_options!r}")
        if isinstance(self.min_per_count, bool) or not isinstance(self.min_per_count, int) or self.min_per_count < 1:
            raise ValueError(f"min_per_count must be an integer >= 1, got {self.min_per_count!r}")
        for name in ("target_accuracy", "delta", "fit_fraction"):
            value = getattr(self, name)
            if isinstance(value, bool) or not 0.0 < value < 1.0:
                raise ValueError(f"{name} must be in (0, 1), got {value!r}")
        if isinstance(self.ood_rejection_rate, bool) or not 0.0 <= self.ood_rejection_rate < 1.0:
            raise ValueError(f"ood_rejection_rate must be in [0, 1), got {self.ood_rejection_rate!r}")
        self.alphas = tuple(sorted({float(a) for a in (*self.alphas, self.alpha)}))
        for a in self.alphas:
            alpha_key(a)  # checks 0 < a < 1
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {self.score!r}")
        if self.reference_size < 10:
            raise ValueError(f"reference_size must be >= 10, got {self.reference_size}")


def gate_threshold(scores, rejection_rate: float, delta: float | None = None) -> float:
    """The k-th smallest of n in-distribution scores; 0 (no gate) when k = 0. The share of exchangeable questions
    below it, over draws of the n, is Beta(k, n + 1 - k) (continuous scores).

    - marginal (``delta`` None): k = floor(rate * (n + 1)), so a new question is refused with probability
      k / (n + 1) <= rate on average over the draw of the n;
    - training-conditional (``delta`` given): the largest k with P(Beta(k, n + 1 - k) > rate) =
      P(Binomial(n, rate) <= k - 1) <= delta, so with probability >= 1 - delta the gate that is served refuses at
      most ``rate`` of in-distribution questions. By symmetry k = n + 1 - the conformal PAC rank at alpha = rate
      (ibedl.core.conformal.conformal_rank), so one rank function serves both.
    """
    s = np.sort(np.asarray(scores, dtype=np.float64))
    if len(s) == 0 or rejection_rate == 0.0:
        return 0.0
    if delta is None:
        k = math.floor(rejection_rate * (len(s) + 1))
    else:
        k = len(s) + 1 - conformal_rank(len(s), rejection_rate, delta)
    return 0.0 if k <= 0 else float(s[k - 1])


def split(n: int, fit_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded (fit, calibration) index arrays; both non-empty."""
    if n < 2:
        raise ValueError(f"calibration needs at least 2 labelled questions, got {n}")
    order = np.random.default_rng(seed).permutation(n)
    k = min(max(1, round(fit_fraction * n)), n - 1)
    return np.sort(order[:k]), np.sort(order[k:])


def posthoc_outputs(kind: str, raw: dict, head_update: dict) -> Outputs:
    """The predictive outputs of raw head outputs (see :func:`calibrate_outputs`) once the post-hoc parameter
    in ``head_update`` (``zeta`` or ``temperature``; absent = neutral) is applied by the head's own map, in float64
    (ibedl.training.head_kinds)."""
    return head_kind(kind).outputs(raw, head_update)


def served_outputs(kind: str, raw: dict, head_update: dict) -> Outputs:
    """What the head answers once the post-hoc parameter in ``head_update`` is set, in float32 as its forward pass
    computes it, so that metrics of these outputs are those of the calibrated predictor. (Calibration's own
    decisions use :func:`posthoc_outputs`, the same map in float64.)"""
    return head_kind(kind).served(raw, head_update)


def _decide(outputs: Outputs, labels: np.ndarray, fit: np.ndarray, cal: np.ndarray,
            config: CalibrationConfig) -> tuple[Abstention, Conformal, dict]:
    """The gate (on the ``fit`` indices), the risk-controlled threshold and the conformal quantiles (on the ``cal``
    indices) of post-hoc ``outputs``; returns them with their record (gate, risk control, in-sample sets)."""
    conf = outputs.confidence
    hits = np.asarray([float(np.argmax(p) == y) for p, y in zip(outputs.probs, labels, strict=True)])
    score = outputs.ood_score()
    ood_name = "inverse_uncertainty" if outputs.uncertainty is not None else "max_probability"
    threshold = gate_threshold(score[fit], config.ood_rejection_rate, config.delta)
    passed = score >= threshold
    # the fit part, independent of the calibration part, is the pilot that picks where the test sequence starts
    risk = control_accuracy(conf[cal][passed[cal]], hits[cal][passed[cal]], config.target_accuracy, config.delta,
                            start_from=(conf[fit][passed[fit]], hits[fit][passed[fit]]))
    answered_cal = passed[cal] & (conf[cal] >= risk.min_confidence)
    gate = {
        "score": ood_name, "rejection_rate": config.ood_rejection_rate, "delta": config.delta, "threshold": threshold,
        "n": len(fit), "rule": "training-conditional: the largest rank k of the fit part's scores with "
        "P(Binomial(n, rate) <= k - 1) <= delta",
        "rejected_on_calibration_part": float(1.0 - passed[cal].mean()),
    }
    if risk.certified:
        log.info("risk control: answer when confidence >= %.4f (accuracy %.3f >= %.3f bound on %d of %d)",
                 risk.min_confidence, risk.accuracy, risk.accuracy_lower_bound, risk.answered, risk.n)
    else:
        log.warning("risk control: no confidence threshold is certified for accuracy %.2f at delta %.2f; "
                    "the adapter will abstain unless confidence is 1", config.target_accuracy, config.delta)
    abstention = Abstention(
        max_uncertainty=1.0, min_confidence=risk.min_confidence, ood_score=ood_name, ood_threshold=threshold,
        how={
            "rule": "abstain 'out_of_distribution' when the OOD score < ood_threshold, else 'min_confidence' "
                    "when max p < min_confidence ('max_uncertainty' only when a request tightens it)",
            "guarantee": f"accuracy on answered in-distribution questions >= {config.target_accuracy} with "
                         f"probability >= {1 - config.delta:g}, if served questions are exchangeable with the "
                         "calibration sample",
            "gate": f"with probability >= {1 - config.delta:g}, at most {config.ood_rejection_rate:g} of "
                    "in-distribution questions refused as out of distribution",
            "gate_rejection_rate": config.ood_rejection_rate,
            "target_accuracy": config.target_accuracy, "delta": config.delta, "certified": risk.certified,
            "answered_accuracy": risk.accuracy, "accuracy_lower_bound": risk.accuracy_lower_bound,
            "coverage": float(answered_cal.mean()), "n": int(len(cal)), "split": "calibration part",
        },
    )
    quantiles = calibrate_quantiles([outputs.probs[i] for i in cal], labels[cal], config.alphas, delta=config.delta)
    conformal = Conformal(alpha=config.alpha, score=config.score, quantiles=quantiles, n=int(len(cal)),
                          delta=config.delta)
    sets = {}
    for s in SCORES:
        q = conformal.quantile(config.alpha, s)
        members = [prediction_set(outputs.probs[i], q, s) for i in cal]
        sets[s] = {"coverage": float(np.mean([y in m for y, m in zip(labels[cal], members, strict=True)])),
                   "mean_size": float(np.mean([len(m) for m in members]))}
    return abstention, conformal, {"gate": gate, "risk_control": risk.to_dict(),
                                   "conformal_in_sample": {"alpha": config.alpha, **sets},
                                   "metrics": metrics.summarise(
                                       [outputs.probs[i] for i in cal], labels[cal],
                                       None if outputs.uncertainty is None else outputs.uncertainty[cal])}


def calibrate_outputs(kind: str, raw: dict, labels, config: CalibrationConfig) -> tuple[dict, Outputs, dict]:
    """Everything ibedl.training.calibrate decides, from the raw head outputs of N labelled questions.

    Args:
        kind: the head kind (``softmax``, ``evidential``, ``ib_edl``).
        raw: per-question lists with the head's post-hoc parameter at its neutral value: ``probs`` always,
            ``alpha`` and ``uncertainty`` for Dirichlet heads, ``sigma`` for IB-EDL.
        labels: (N,) answer indices.

    Returns:
        (head_update, outputs, sections): the head config keys to set (``zeta`` or ``temperature``), the
        post-hoc outputs of all N questions, and the manifest's ``abstention``, ``conformal``,
        ``calibration`` and ``reference`` sections.
    """
    labels = np.asarray(labels, dtype=np.int64)
    n = len(labels)
    fit, cal = split(n, config.fit_fraction, config.seed)
    counts = np.asarray([len(p) for p in raw["probs"]])
    present = sorted({int(c) for c in counts})
    groups = {c: counts == c for c in present if (counts == c).sum() >= config.min_per_count}
    skipped = sorted(set(present) - set(groups))
    if skipped:
        log.warning("option counts %s have fewer than %d questions each (%s): not claimed, answers with them will "
                    "say that no promise holds (--min-per-count sets the minimum)", skipped, config.min_per_count,
                    ", ".join(f"{c}: {int((counts == c).sum())}" for c in skipped))
    main = None  # set when calibrated per option count: each claimed count then keeps its own promises
    if len(present) > 1 and groups:
        if config.main_options is not None and config.main_options not in groups:
            raise ValueError(f"main_options {config.main_options} is not a count calibrated here "
                             f"({sorted(groups)})")
        # the traffic's usual count, else the most common: the top level's and the drift reference's
        main = config.main_options or max(groups, key=lambda c: (int(groups[c].sum()), -c))
    # The post-hoc parameter is one for every count (the head's); per count it is fitted on the traffic's usual
    # count, whose calibration it would otherwise trade for the others'. The thresholds and sets below are chosen
    # after it, each count's on its own questions, so every count's promises hold whatever it is. Without the
    # post-hoc step the parameter is set neutral.
    step = head_kind(kind)  # the head kind's post-hoc step (ibedl.training.head_kinds)
    fit_on = fit if main is None else fit[counts[fit] == main]
    head_update, posthoc = step.fit(raw, labels, fit_on) if config.posthoc else (step.neutral(), {"kind": None})
    outputs = posthoc_outputs(kind, raw, head_update)
    conf = outputs.confidence
    if main is not None:
        decided = {c: _decide(outputs, labels, fit[g[fit]], cal[g[cal]], config) for c, g in groups.items()}
        abstention, conformal, record = decided[main]
        abstention.by_options = {str(c): {"ood_threshold": a.ood_threshold, "min_confidence": a.min_confidence,
                                          "how": a.how} for c, (a, _, _) in decided.items()}
        conformal.by_options = {str(c): {"quantiles": k.quantiles, "n": k.n} for c, (_, k, _) in decided.items()}
        claimed, by_options = sorted(groups), {str(c): r for c, (_, _, r) in decided.items()}
    else:  # one count (claimed when it has enough questions), or a mixture of counts none of which can be claimed
        abstention, conformal, record = _decide(outputs, labels, fit, cal, config)
        claimed, by_options = sorted(groups), None
    if main is not None:
        posthoc = {**posthoc, "fitted_on_options": main}
    # drift is watched on the traffic's usual count: per count, the reference is the main count's questions
    pool = np.arange(n) if main is None else np.flatnonzero(counts == main)
    rng = np.random.default_rng(config.seed)
    ref_idx = np.sort(rng.choice(pool, size=min(config.reference_size, len(pool)), replace=False))
    sample_counts = sorted({int(c) for c in counts})
    reference = {
        "split": "calibration sample (fit and calibration parts)"
                 + ("" if main is None else f", questions with {main} options"),
        # the option count whose questions the reference holds (None: several): the service watches that count's
        # answers alone, since confidence and the uncertainty mass move with the count (max p >= 1/C, u = C/alpha0)
        "options": main if main is not None else sample_counts[0] if len(sample_counts) == 1 else None,
        "uncertainty": (None if outputs.uncertainty is None
                        else [round(float(outputs.uncertainty[i]), 6) for i in ref_idx]),
        "confidence": [round(float(conf[i]), 6) for i in ref_idx],
    }
    calibration = {
        "n": n, "n_fit": int(len(fit)), "n_calibration": int(len(cal)), "seed": config.seed,
        "option_counts": claimed,
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(config).items()},
        "posthoc": posthoc, **record,
        **({"by_options": by_options} if by_options else {}),
        "metrics": metrics.summarise([outputs.probs[i] for i in cal], labels[cal],
                                     None if outputs.uncertainty is None else outputs.uncertainty[cal]),
    }
    sections = {"abstention": asdict(abstention), "conformal": asdict(conformal), "calibration": calibration,
                "reference": reference}
    return head_update, outputs, sections


def raw_outputs(predictor, questions: list[MCQuestion], batch_size: int = 8, progress: bool = True) -> tuple[str, dict]:
    """Predict ``questions`` with the head's post-hoc parameter neutral; returns (head kind, raw dict)."""
    from ibedl.training.evaluate import predict_all

    config = predictor.head.config
    saved = (config.zeta, config.temperature)
    for head in predictor.heads:
        head.config.zeta, head.config.temperature = POSTHOC_NEUTRAL["zeta"], POSTHOC_NEUTRAL["temperature"]
    try:
        preds, _ = predict_all(predictor, questions, batch_size, progress, desc="calibration")
    finally:
        for head in predictor.heads:
            head.config.zeta, head.config.temperature = saved
    raw = {"probs": [p.probs for p in preds], "offset": config.offset}
    if preds[0].alpha is not None:
        raw["alpha"] = [p.alpha for p in preds]
        raw["sigma"] = [p.sigma for p in preds] if preds[0].sigma is not None else None
    kind = served_kind(config.kind, raw)
    return kind, raw


def calibrate_predictor(predictor, questions: list[MCQuestion], config: CalibrationConfig, batch_size: int = 8,
                        progress: bool = True) -> tuple[dict, Outputs]:
    """Run the model once on labelled ``questions``, calibrate, set the heads' post-hoc parameter and return the
    manifest sections (``abstention``, ``conformal``, ``calibration``, ``reference``) and the post-hoc outputs of
    ``questions`` as the calibrated predictor answers them (:func:`served_outputs`; ``extra["seconds"]``: the time
    the model took)."""
    import time

    missing = [i for i, q in enumerate(questions) if q.answer is None]
    if missing:
        raise ValueError(f"questions {missing[:5]} have no answer to calibrate on")
    start = time.perf_counter()
    kind, raw = raw_outputs(predictor, questions, batch_size, progress)
    seconds = time.perf_counter() - start
    head_update, _, sections = calibrate_outputs(kind, raw, [q.answer for q in questions], config)
    for head in predictor.heads:
        for key, value in head_update.items():
            setattr(head.config, key, value)
    outputs = served_outputs(kind, raw, head_update)
    outputs.extra["seconds"] = seconds
    return sections, outputs


def apply_sections(manifest: Manifest, head: dict, sections: dict) -> None:
    """Write the (calibrated) head config and the calibration's sections into ``manifest``."""
    manifest.head = head
    for key in ("abstention", "conformal", "calibration", "reference"):
        setattr(manifest, key, sections[key])


def _share_files(source: Path, target: Path, manifest: Manifest) -> None:
    """Hard-link (or copy) every member's adapter and head files, and the quantisation sample, from ``source`` into
    ``target``."""
    from ibedl.core.artifact import ADAPTER_FILES, HEAD_FILE

    files = [Path(member) / name for member in manifest.members for name in (*ADAPTER_FILES, HEAD_FILE)]
    if quantization_sample.sha256(source) is not None:
        files.append(Path(quantization_sample.FILE))
    for path in files:
        src, dst = source / path, target / path
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.exists():
            dst.unlink()
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)


def check_output(output: str | None, artifact: str) -> None:
    """ValueError unless ``output`` (--output) can take the calibrated artifact without destroying anything: a
    directory that does not exist yet or is empty, or --artifact itself (calibration in place, as without --output).
    Another artifact, or any other directory with files, would have its weights and manifest replaced; a file
    cannot hold an artifact."""
    if output is None or Path(output).resolve() == Path(artifact).resolve():
        return
    target = check_writable(output, "--output", directory=True)
    if target.is_dir() and any(target.iterdir()) and not same_weights(target, Path(artifact)):
        raise ValueError(f"--output {output} holds files that are not a calibration of {artifact} (its manifest "
                         "names other weights, or it has none): the calibrated artifact would replace them; name a "
                         "new or empty directory, or an earlier --output of this artifact")


def same_weights(directory: Path, artifact: Path) -> bool:
    """Whether ``directory`` holds an artifact whose manifest names the weight files (their sha256) of ``artifact``'s:
    an earlier calibration of it, which calibrating again may replace."""
    try:
        files = read_manifest(directory).files
        return bool(files) and files == read_manifest(artifact).files
    except (ValueError, OSError):  # no manifest, or one that does not read: not a calibration of it
        return False


CONFIG_FLAGS = ("target_accuracy", "delta", "alpha", "score", "ood_rejection_rate", "fit_fraction", "min_per_count",
                "main_options")  # the settings the command line may give (None: not given)


def calibration_config(args: argparse.Namespace, recorded: dict | None = None) -> CalibrationConfig:
    """The calibration's settings: each one the command gives, else the one in ``recorded`` (a recalibration on
    labels: the settings the served calibration was made with), else the default. ValueError for a bad value."""
    defaults = CalibrationConfig()
    chosen = {name: getattr(args, name) if getattr(args, name, None) is not None
              else (recorded or {}).get(name, getattr(defaults, name)) for name in CONFIG_FLAGS}
    return CalibrationConfig(**chosen, seed=args.seed, posthoc=not args.no_posthoc)


def settings_for(args: argparse.Namespace, manifest: Manifest, key: str, config: CalibrationConfig,
                 raw: dict) -> CalibrationConfig:
    """``config``, or for a recalibration on labels (``raw``: their served outputs) the settings the served
    calibration on ``key`` was made with but for those the command gives, without a post-hoc refit (the outputs are
    the served ones). Its main option count is kept only where the labels hold ``min_per_count`` questions of it:
    after a shift in the traffic's options the labels' most common count is the main one."""
    if args.dataset != "feedback":
        return config
    config = calibration_config(args, recorded_config(manifest, key))
    config.posthoc = False
    if args.main_options is None and config.main_options is not None:
        have = Counter(len(p) for p in raw["probs"])[config.main_options]
        if have < config.min_per_count:
            log.info("main option count %d of the served calibration: only %d labels of it (--min-per-count %d); "
                     "the labels' most common count is the main one", config.main_options, have, config.min_per_count)
            config.main_options = None
    return config


def recorded_config(manifest: Manifest, key: str) -> dict | None:
    """The settings the calibration made on ``key`` recorded (``calibration.config``), or None."""
    served = manifest.calibration_for(key)
    return None if served is None else (served.record or {}).get("config")


def check_arguments(args: argparse.Namespace) -> None:
    """ValueError naming the first argument of ``args`` that cannot work, before the model runs: one only
    ``--dataset feedback`` reads, a ``--device`` this machine lacks (ibedl.core.base_model.check_device), an
    ``--output`` or a ``--save-outputs`` that cannot be written (or an ``--output`` whose files would be lost)."""
    if args.dataset != "feedback":
        for flag, given in (("--from-seq", args.from_seq is not None), ("--since-change", args.since_change)):
            if given:
                raise ValueError(f"{flag} goes with --dataset feedback (the labels sent back to the service), not "
                                 f"--dataset {args.dataset}")
    check_device(args.device)
    check_output(args.output, args.artifact)
    if args.save_outputs:
        check_writable(args.save_outputs, "--save-outputs")


def decided(kind: str, raw: dict, labels: list[int], config: CalibrationConfig) -> tuple[dict, dict]:
    """:func:`calibrate_outputs`' head update and sections; ValueError when it promises nothing (no option count has
    ``min_per_count`` questions in the sample) or cannot calibrate ``main_options``."""
    head_update, _, sections = calibrate_outputs(kind, raw, labels, config)
    if not sections["calibration"]["option_counts"]:
        found = Counter(len(p) for p in raw["probs"])
        raise ValueError(f"no option count has the {config.min_per_count} questions --min-per-count asks for in this "
                         f"sample ({', '.join(f'{c} options: {k}' for c, k in sorted(found.items()))}), so the "
                         "calibration would promise nothing for any answer; nothing was written. Label more "
                         "questions, or lower --min-per-count (each count's promises then rest on fewer questions: "
                         "wider sets, fewer answers)")
    return head_update, sections


def written_version(directory: Path) -> str | None:
    """The version of the artifact an earlier calibration wrote into ``directory`` (an --output used before), or
    None."""
    try:
        return str(read_manifest(directory).version)
    except (ValueError, OSError):
        return None


def later_version(version: str, other: str | None) -> str:
    """The later of two versions (integers compared as numbers; otherwise ``version``'s, unless ``other`` is the
    same with more appended): a calibration written over an earlier output takes a number past both."""
    if other is None:
        return version
    if version.isdigit() and other.isdigit():
        return str(max(int(version), int(other)))
    return other if other.startswith(version) else version


def next_version(version: str) -> str:
    """"3" -> "4"; a version that is not an integer gets ".recal" appended."""
    return str(int(version) + 1) if str(version).isdigit() else f"{version}.recal"


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m ibedl.training.calibrate``."""
    from ibedl.training.data import DATASETS

    defaults = CalibrationConfig()
    parser = argparse.ArgumentParser(prog="python -m ibedl.training.calibrate", description=__doc__.split("\n\n")[0],
                                     epilog="Run it on data like the traffic you serve: the guarantees hold for "
                                     "questions exchangeable with the calibration sample.")
    parser.add_argument("--artifact", required=True, help="adapter directory (with manifest.json)")
    parser.add_argument("--dataset", required=True, help=f"labelled data: one of {sorted(DATASETS)}, or feedback "
                        "(the labels sent back to the service: --path is its IBEDL_FEEDBACK_DB, or its "
                        "IBEDL_FEEDBACK_DSN; the settings below not given are then those the served calibration "
                        "was made with)")
    parser.add_argument("--split", default="validation", help="split to calibrate on (default validation)")
    parser.add_argument("--path", help="file for --dataset jsonl")
    parser.add_argument("--limit", type=int, help="a seeded random subset of this size")
    parser.add_argument("--output", help="write the calibrated artifact into this new or empty directory, or an "
                        "earlier --output of this artifact (a version past both) (default: update --artifact in place)")
    parser.add_argument("--target-accuracy", type=float,
                        help=f"accuracy guaranteed on answered questions (default {defaults.target_accuracy})")
    parser.add_argument("--delta", type=float,
                        help="allowed probability, over the calibration draw, that the served threshold's answered "
                        "accuracy or the served sets' coverage misses its level (default "
                        f"{defaults.delta})")
    parser.add_argument("--alpha", type=float,
                        help=f"miscoverage of the served prediction sets (default {defaults.alpha})")
    parser.add_argument("--score", choices=SCORES, help=f"conformal score served by default ({defaults.score})")
    parser.add_argument("--ood-rejection-rate", type=float,
                        help=f"in-distribution questions the gate may refuse (default {defaults.ood_rejection_rate}; "
                        "0: no gate)")
    parser.add_argument("--fit-fraction", type=float,
                        help=f"share fitting the post-hoc step and the gate (default {defaults.fit_fraction})")
    parser.add_argument("--no-posthoc", action="store_true", help="keep zeta / temperature neutral")
    parser.add_argument("--seed", type=int, default=0, help="seed of the --limit subset and of the split")
    parser.add_argument("--option-counts", type=parse_counts,
                        help="calibrate for these option counts (e.g. 2,3,4,5,6): each question is also asked with "
                        "each other count (its own distractors dropped, or wrong options borrowed from other "
                        "questions; ibedl.training.data.option_counts) and the gate, threshold and sets are "
                        "calibrated per count; answers with any other count say that no guarantee holds")
    parser.add_argument("--per-count", type=int, default=None,
                        help="questions asked with each count other than their own (default: all of them)")
    parser.add_argument("--min-per-count", type=int,
                        help="questions an option count needs in the sample to be claimed (default "
                        f"{defaults.min_per_count}); answers with a count that has fewer say that no promise holds")
    parser.add_argument("--main-options", type=int,
                        help="with several option counts: the count of the traffic's usual questions, which the "
                        "top level and the drift reference are for (default: the data's own count, else the "
                        "most common count in --outputs)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--since-change", action="store_true",
                       help="with --dataset feedback: only the labels from the change the service detected on (the "
                       "first label of the change that suspended the version's promises)")
    where.add_argument("--from-seq", type=int, default=None,
                       help="with --dataset feedback: only the labels from this store sequence number on")
    parser.add_argument("--outputs", help="read the model's raw outputs on --dataset/--split from this file "
                        "(written by --save-outputs or python -m benchmarks.decisions score) instead of running the "
                        "model")
    parser.add_argument("--evaluate-split", help="after calibrating, measure the adapter as calibrated on this split "
                        "of --dataset (e.g. test) and record it as the manifest's metrics for that split")
    parser.add_argument("--evaluate-outputs", help="with --evaluate-split: read that split's raw outputs from this "
                        "file (default: --outputs; computed on the same backend, checked)")
    parser.add_argument("--save-outputs",
                        help="write the model's raw outputs here, to recalibrate later without the model")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=1024,
                        help="prompt token limit, as served (the service's IBEDL_MAX_TOKENS, default 1024): "
                        "calibrate on the prompts the service will read")
    parser.add_argument("--base-model", help="override the manifest's base model reference")
    parser.add_argument("--backend", choices=[b for b in BACKENDS if b != "auto"],
                        help="inference backend to calibrate on (default torch, in --device's --dtype); the "
                        "calibration is recorded for that backend and precision, beside the others the artifact "
                        "carries (on CUDA: torch-cuda-fp32, torch-cuda-bf16, torch-cuda-nf4-bf16, "
                        "torch-cuda-merged-fp32, torch-cuda-merged-bf16, torch-cuda-graphs-fp32, "
                        "torch-cuda-graphs-bf16, what auto serves there). With --outputs: "
                        "the backend that file's outputs were computed on (checked); with "
                        "--dataset feedback: the labelled answers of the backend that served them are taken (default: "
                        "the one most of them name)")
    parser.add_argument("--device", help="cpu or cuda (default: CUDA when present)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="model dtype (default: float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--load-in-4bit", action="store_true",
                        help="load the base in 4-bit NF4 (bitsandbytes, CUDA), as IBEDL_LOAD_IN_4BIT serves it")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    from ibedl.core.artifact import ArtifactError
    from ibedl.training.data import load_dataset
    from ibedl.training.data.errors import DatasetError

    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.limit is not None and args.limit < 2:
        parser.error(f"--limit must be >= 2, got {args.limit}")
    if args.evaluate_outputs and not args.evaluate_split:
        parser.error("--evaluate-outputs goes with --evaluate-split")
    if args.outputs and (args.limit or args.save_outputs):
        parser.error("--outputs reads a whole stored split: it takes neither --limit nor --save-outputs")
    source = Path(args.artifact)
    stream = f"{args.dataset}_{args.split}"
    try:
        config = calibration_config(args)
        check_arguments(args)
        manifest = check_artifact(source)
        if not manifest.files:
            raise ArtifactError(f"{source} was written by an older version (no weight checksums in its manifest): "
                                f"run python -m ibedl.core.migrate {source} first, then calibrate it")
        kind, raw, labels, key = labelled_outputs(args, source, manifest, config, load_dataset)
        config = settings_for(args, manifest, key, config, raw)
        quantized = quantization_record(source, key, outputs_isa(args.outputs, key) if args.outputs else None)
        made = arithmetic_made_on(args, key)
    except (DatasetError, ArtifactError, ValueError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.save_outputs:
        save_outputs(args.save_outputs, source, manifest, {stream: {"labels": labels, **raw}}, kind, raw["offset"],
                     args.max_tokens,
                     extra={"calibration_key": key, **({"int8_isa": quantized["isa"]} if quantized else {}),
                            **({"bf16_isa": made["bf16"]["isa"]} if "bf16" in made else {}),
                            **({"main_options": config.main_options} if config.main_options else {})})
    try:
        head_update, sections = decided(kind, raw, labels, config)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dataset == "feedback":  # decided on the served outputs: the post-hoc parameter they were served with stays
        head_update = served_posthoc(manifest, key)
    evaluated = None
    if args.evaluate_split:
        eval_args = argparse.Namespace(**{**vars(args), "split": args.evaluate_split, "limit": None,
                                          "option_counts": None})
        try:
            evaluate_from = args.evaluate_outputs or args.outputs
            if evaluate_from:
                evaluated_on = key if evaluate_from == args.outputs else outputs_key(evaluate_from, None, manifest)
                if evaluated_on != key:
                    raise ValueError(f"{evaluate_from} holds outputs computed on {evaluated_on}, "
                                     f"not on {key}: evaluate on the arithmetic calibrated on")
                ekind, eraw, elabels = read_outputs(evaluate_from, f"{args.dataset}_{args.evaluate_split}", source,
                                                    manifest)
            else:
                ekind, eraw, elabels, _ = run_model(eval_args, source, load_dataset)
        except (DatasetError, ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        out = posthoc_outputs(ekind, eraw, head_update)
        evaluated = metrics.summarise(out.probs, elabels, out.uncertainty)
    sections["calibration"].update({
        "backend": key, "dataset": args.dataset, "split": args.split, "path": without_password(args.path),
        **({"path_sha256": sha256_file(Path(args.path))} if args.dataset == "jsonl" and args.path
           and Path(args.path).is_file() else {}),
        "limit": args.limit, "outputs": args.outputs, "max_tokens": args.max_tokens,
        "evaluated_split": args.evaluate_split,
        "command": "python -m ibedl.training.calibrate " + " ".join(
            shlex.quote(without_password(a)) for a in (argv if argv is not None else sys.argv[1:])),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "previous_version": str(manifest.version),
        **({"quantization": quantized} if quantized else {}),
        **made,
    })
    # A calibration that replaces one the artifact carries changes the answers served on its backend: a new version,
    # whose labels and realised guarantees are counted apart. One added for a backend it never carried changes no
    # answer that was served (that backend could not serve it): the version stays.
    replaced = key in manifest.calibration_keys()
    record(manifest, key, head_update, sections, {args.evaluate_split: evaluated} if evaluated is not None else {})
    dropped, stale = drop_other_sources(manifest, key)
    target = Path(args.output) if args.output else source
    earlier = written_version(target) if target.resolve() != source.resolve() else None
    if replaced or dropped or earlier is not None:  # an earlier output's version is never written again
        manifest.version = next_version(later_version(str(manifest.version), earlier))
    if target.resolve() != source.resolve():
        _share_files(source, target, manifest)
    write_manifest(target, manifest)
    write_card(target, manifest)  # the card shows the new thresholds
    check_artifact(target, verify=True)
    cal = manifest.calibration_for(key).record
    print(json.dumps({"artifact": str(target), "version": manifest.version, "calibration": key,
                      "posthoc": cal["posthoc"],
                      "gate": cal["gate"], "risk_control": cal["risk_control"],
                      "conformal_in_sample": cal["conformal_in_sample"],
                      "dropped": dropped, "stale": stale}, indent=2))
    say_other_sources(parser, argv if argv is not None else sys.argv[1:], args, target, dropped, stale)
    return 0


def say_other_sources(parser: argparse.ArgumentParser, argv: list[str], args, target: Path, dropped: list[str],
                      stale: list[str]) -> None:
    """Say on stderr which calibrations made on other questions were ``dropped`` and which top-level one is
    ``stale``, each with the command (this run's, ``argv``) that calibrates it on this run's questions in ``target``;
    none after a run on stored outputs (``--outputs``: how they were computed, e.g. each option count asked, is the
    file's, not the command line's)."""
    def how(k: str) -> str:
        if args.outputs:
            return (f"compute that backend's outputs as {args.outputs}'s were computed, with "
                    f"{' '.join(backend_arguments(k))}")
        return command_on(parser, argv, target, k)

    for k in dropped:
        print(f"dropped the {k} calibration: it was made on other questions, so its promises held for those; its "
              f"backend is served again once calibrated on these: {how(k)}", file=sys.stderr)
    for k in stale:
        print(f"warning: the top-level {k} calibration was made on other questions and is still served on its "
              f"backend: recalibrate it on these ({how(k)})", file=sys.stderr)


def labelled_outputs(args, source: Path, manifest: Manifest, config: CalibrationConfig,
                     load_dataset) -> tuple[str, dict, list[int], str]:
    """(head kind, raw outputs, labels, calibration key) of the labelled sample ``args`` name: the feedback store's
    served outputs (``--dataset feedback``; :func:`settings_for` gives its settings), a stored outputs file
    (``--outputs``), or the model run on the data. Sets ``config.main_options`` where the sample says it."""
    if args.dataset == "feedback":
        if args.outputs or args.limit or args.evaluate_split:
            raise ValueError("--dataset feedback reads the outputs its receipts carried: it takes neither "
                             "--outputs, --limit nor --evaluate-split")
        if not args.path:
            raise ValueError("--dataset feedback needs --path: the service's feedback store (IBEDL_FEEDBACK_DB)")
        # the arithmetic the labelled answers were computed on: --backend's, else the one most of them name
        return feedback_outputs(args.path, manifest, from_seq=args.from_seq, since_change=args.since_change,
                                backend=args.backend)  # its settings: settings_for
    if args.outputs:
        kind, raw, labels = read_outputs(args.outputs, f"{args.dataset}_{args.split}", source, manifest)
        config.main_options = args.main_options or json.loads(Path(args.outputs).read_text()).get("main_options")
        return kind, raw, labels, outputs_key(args.outputs, args.backend, manifest)
    kind, raw, labels, key = run_model(args, source, load_dataset)
    config.main_options = args.main_options
    return kind, raw, labels, key


def backend_arguments(key: str) -> list[str]:
    """The arguments that compute calibration key ``key``'s arithmetic (:func:`ibedl.core.backends.calibration_key`
    names CUDA's ``-cuda-``): ``--backend`` the key where a backend has its name (``openvino-int8``,
    ``torch-cuda-nf4-bf16``), with its device; else the backend, device, dtype and 4-bit loading whose key it is
    (``torch-fp32``: ``--backend torch --device cpu --dtype float32``); else ``--backend`` the key (refused, named)."""
    device = "cuda" if "-cuda-" in f"{key}-" else "cpu"
    if key in BACKENDS:
        return ["--backend", key, "--device", device]
    owner = of_key(key)
    for dtype, four_bit in itertools.product(("float32", "bfloat16", "float16"), (False, True)):
        if owner is not None and calibration_key(owner.name, device, dtype, four_bit) == key:
            return ["--backend", owner.name, "--device", device, "--dtype", dtype, *(["--load-in-4bit"] * four_bit)]
    return ["--backend", key]


def calibration_source(record: dict) -> tuple | None:
    """Where the questions of a calibration ``record`` (its ``calibration`` section) came from: (dataset, split) for
    a built-in dataset, whatever subset ``--limit`` drew of it (the same questions' distribution); ("jsonl", the
    file's sha256) for a JSONL file (recorded since calibrations record it; ("jsonl", path) before). None where
    unknown: no record, or one that names no dataset (written by training, or before calibrations recorded it), a
    JSONL calibration made from stored outputs without its file, and the feedback store's labels (those of the
    backend that answered; the others' calibrations are never judged by them)."""
    from ibedl.training.data import DATASETS

    dataset = (record or {}).get("dataset")
    if dataset not in DATASETS:  # training's "the run's validation data", feedback, none
        return None
    if dataset == "jsonl":
        if record.get("path_sha256"):
            return "jsonl", record["path_sha256"]
        path = record.get("path")
        if path and Path(path).is_file():  # recorded before the content was: the file as it is now
            return "jsonl", sha256_file(Path(path))
        return ("jsonl-path", path) if path else None
    return dataset, record.get("split")


def drop_other_sources(manifest: Manifest, key: str) -> tuple[list[str], list[str]]:
    """Drop from ``manifest`` the backend calibrations made on questions from another source than ``key``'s (just
    recorded): both known and different, never on an unknown one. Returns (the keys dropped, the top-level key when
    it is such a one: it cannot be dropped)."""
    source = calibration_source(manifest.calibration_for(key).record)
    if source is None:
        return [], []
    other = []
    for k in manifest.calibration_keys():
        theirs = calibration_source(manifest.calibration_for(k).record) if k != key else None
        if theirs is not None and theirs != source and {theirs[0], source[0]} != {"jsonl", "jsonl-path"}:
            other.append(k)  # (a file known by its content and one known by its path alone may be the same one)
    dropped = [k for k in other if k != manifest.calibrated_on]
    for k in dropped:
        del manifest.backend_calibrations[k]
    return dropped, [k for k in other if k == manifest.calibrated_on]


def option_named(options, name: str) -> str | None:
    """The option of ``options`` that ``name`` names as argparse reads it: itself, else the one it abbreviates."""
    if name in options:
        return name
    prefixed = [o for o in options if o.startswith(name)]
    return prefixed[0] if len(prefixed) == 1 else None


RUN_ONLY = ("--artifact", "--output", "--backend", "--device", "--dtype", "--load-in-4bit", "--outputs",
            "--save-outputs", "--evaluate-outputs")  # what command_on replaces: where, and on which arithmetic


def command_on(parser: argparse.ArgumentParser, argv: list[str], target: Path, key: str) -> str:
    """This run's command (``argv``, parsed by ``parser``: every setting kept, abbreviated options too) made to
    calibrate ``key``'s backend in ``target``, in place, the model run on that backend."""
    long = {o: a for a in parser._actions for o in a.option_strings if o.startswith("--")}
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        option = option_named(long, a.split("=", 1)[0]) if a.startswith("--") else None
        if option in RUN_ONLY:
            skip = "=" not in a and long[option].nargs != 0
        else:
            kept.append(a)
    return " ".join(shlex.quote(without_password(a)) for a in [
        "python", "-m", "ibedl.training.calibrate", "--artifact", str(target), *kept, *backend_arguments(key)])


def served_posthoc(manifest: Manifest, key: str) -> dict:
    """The post-hoc parameter (``zeta`` or ``temperature``) the service answers with on backend and precision
    ``key``: that calibration's own, else the top-level head's (as ``Predictor.use_calibration`` sets it). A
    recalibration on served outputs records it again: an empty one made a restarted replica serve the top-level
    value, other numbers than those the thresholds were set on."""
    head = manifest.head_config()
    top = {} if head.posthoc_key is None else {head.posthoc_key: getattr(head, head.posthoc_key)}
    own = manifest.calibration_for(key)
    return {**top, **(own.head if own is not None else {})}


def record(manifest: Manifest, key: str, head_update: dict, sections: dict, evaluated: dict) -> None:
    """Write a calibration made on backend and precision ``key`` into ``manifest``: the top-level sections when
    ``key`` is its ``calibrated_on`` (test metrics measured with an older post-hoc parameter are kept as
    ``test_before_calibration``), else ``backend_calibrations[key]``."""
    if key != manifest.calibrated_on:
        manifest.set_calibration(key, head_update, sections, evaluated)
        return
    before = (manifest.head.get("zeta", 0.0), manifest.head.get("temperature", 1.0))
    apply_sections(manifest, {**manifest.head, **head_update}, sections)
    if (manifest.head.get("zeta", 0.0), manifest.head.get("temperature", 1.0)) != before and "test" in manifest.metrics:
        # Measured with the old post-hoc parameter: kept for the record, under a name that says so.
        manifest.metrics["test_before_calibration"] = manifest.metrics.pop("test")
    manifest.metrics.update(evaluated)


def static_int8(key: str) -> bool:
    """Whether calibration key ``key`` names the arithmetic of a static int8 backend (``Backend.static_int8``:
    quantised on the artifact's quantisation sample, its numbers those of the CPU's int8 class)."""
    backend = of_key(key)
    return backend is not None and backend.static_int8


def quantization_record(directory: Path, key: str, isa: str | None = None) -> dict | None:
    """What a calibration made on static int8 records of the trunk's quantisation (the artifact's sample file and
    its sha256, and the int8 instruction set ``isa`` the outputs were computed on, default this machine's: what the
    service checks), None for other backends; ValueError when the artifact carries no sample (outputs computed on
    an int8 trunk quantised on questions the artifact does not hold)."""
    if not static_int8(key):
        return None
    sha = quantization_sample.sha256(directory)
    if sha is None:
        raise ValueError(f"{directory} carries no {quantization_sample.FILE}: the int8 trunk these outputs come from "
                         "was quantised on questions the artifact does not hold, so no service could rebuild it; "
                         f"calibrate without --outputs (--backend {of_key(key).name} writes the sample)")
    return {"file": quantization_sample.FILE, "questions": len(quantization_sample.read(directory)), "sha256": sha,
            "isa": isa or int8_isa()}


def outputs_key(path, backend: str | None, manifest: Manifest | None = None) -> str:
    """The backend and precision the raw outputs in ``path`` were computed on: as recorded (``calibration_key``);
    for a file written before backends were recorded, the key of the ``manifest``'s calibration that records it was
    made from this file, else torch in the precision of the devices its streams name. ValueError when ``backend``
    (the --backend given) is another one (``Backend.owns_key``)."""
    data = json.loads(Path(path).read_text())
    key = data.get("calibration_key")
    if key is None and manifest is not None:
        key = next((k for k in manifest.calibration_keys()
                    if manifest.calibration_for(k).record.get("outputs") == str(path)), None)
    if key is None:
        devices = {str(s.get("device", "cpu")) for s in data["streams"].values()}
        cuda = any(d.startswith("cuda") for d in devices)
        key = calibration_key("torch", "cuda" if cuda else "cpu", "bfloat16" if cuda else "float32")
    if backend is not None and not get(backend).owns_key(key):
        raise ValueError(f"{path} holds outputs computed on {key}, not on backend {backend}: answer the data on "
                         f"{backend} (--backend {backend} without --outputs)")
    return key


def arithmetic_made_on(args, key: str) -> dict:
    """What the calibration records of the CPU arithmetic its outputs were computed on, beyond static int8's
    (ibedl.core.arithmetic.made_on): this CPU's when the model runs here, the outputs file's when they are read from
    one (``bf16_isa``: nothing when it does not say), nothing for labels sent back (replicas computed those)."""
    if args.outputs:
        isa = json.loads(Path(args.outputs).read_text()).get("bf16_isa")
        return {"bf16": {"isa": isa}} if isa is not None and arithmetic.cpu_bf16(of_key(key)) else {}
    if args.dataset == "feedback":
        return {}
    return arithmetic.made_on(of_key(key))


def outputs_isa(path, key: str) -> str | None:
    """The int8 instruction set (ibedl.core.quantization_sample.int8_isa) the static int8 outputs in ``path`` were
    computed on, None for other backends; ValueError when such a file does not record it (its calibration could not
    say which CPUs it holds on)."""
    if not static_int8(key):
        return None
    isa = json.loads(Path(path).read_text()).get("int8_isa")
    if isa is None:
        raise ValueError(f"{path} holds static int8 outputs but not the int8 instruction set they were computed on "
                         f"(int8_isa): int8 arithmetic differs between CPUs with and without VNNI, so compute them "
                         f"again on the CPU kind to serve (--backend {of_key(key).name} --save-outputs FILE)")
    return isa


def run_model(args, source: Path, load_dataset) -> tuple[str, dict, list[int], str]:
    """Load the artifact (on ``args.backend``) and its labelled data and answer them with the post-hoc parameter
    neutral. Returns (head kind, raw outputs, labels, calibration key of the backend and precision that ran)."""
    from ibedl.core.predictor import Predictor
    from ibedl.training.evaluate import some_questions

    questions = some_questions(load_dataset(args.dataset, args.split, path=args.path, limit=args.limit,
                                            seed=args.seed), args.dataset, args.split, args.path)
    if getattr(args, "option_counts", None):
        own = Counter(len(q.options) for q in questions).most_common(1)[0][0]
        if getattr(args, "main_options", None) is None and own in args.option_counts:
            args.main_options = own  # the data's own count: what the traffic usually asks
        questions = vary_option_counts(questions, args.option_counts, args.per_count, args.seed)
    missing = [i for i, q in enumerate(questions) if q.answer is None]
    if missing:
        raise ValueError(f"questions {missing[:5]} of {args.dataset}/{args.split} have no answer to calibrate on")
    if args.backend is not None and get(args.backend).static_int8 and quantization_sample.sha256(source) is None:
        # quantised on training questions (the calibration questions choose nothing else), kept in the artifact so
        # every machine quantises the trunk this calibration is made on
        sample = load_dataset(args.dataset, "train", path=args.path, limit=quantization_sample.QUESTIONS,
                              seed=args.seed)
        quantization_sample.write(source, sample)
        log.info("wrote %s (%d %s training questions) into %s: %s is quantised on them",
                 quantization_sample.FILE, len(sample), args.dataset, source, args.backend)
    predictor = Predictor.from_artifact(source, base_model=args.base_model, device=args.device,
                                        dtype=getattr(torch, args.dtype) if args.dtype else None,
                                        backend=args.backend or "torch", load_in_4bit=args.load_in_4bit)
    predictor.max_tokens = args.max_tokens
    kind, raw = raw_outputs(predictor, questions, args.batch_size, progress=not args.no_progress)
    return kind, raw, [q.answer for q in questions], predictor.calibration_key


OUTPUTS_FORMAT = "ibedl-raw-outputs/1"


def weights_sha256(directory: Path, manifest: Manifest) -> str:
    """sha256 over every member's adapter and head weights: what raw outputs depend on besides the base model."""
    import hashlib

    from ibedl.core.artifact import HEAD_FILE

    digest = hashlib.sha256()
    for member in manifest.members:
        for name in ("adapter_model.safetensors", HEAD_FILE):
            digest.update((Path(directory) / member / name).read_bytes())
    return digest.hexdigest()


def save_outputs(path, directory: Path, manifest: Manifest, streams: dict, kind: str, offset: float,
                 max_tokens: int, extra: dict | None = None) -> Path:
    """Raw outputs (post-hoc parameter neutral) of named streams: ``{name: {labels, probs, alpha, sigma}}``,
    each value to 9 significant digits (a float32 read back exactly, a float64 within 5e-10 relative). Fixed
    decimals would round a confident model's small probabilities to 0, which moves a temperature fitted on the file
    away from the one fitted on the model's own outputs (the MAP twin's: 2.337 against 2.279 at 6 decimals)."""
    rnd = lambda rows: None if rows is None else [[float(f"{float(x):.9g}") for x in r] for r in rows]  # noqa: E731
    data = {
        "format": OUTPUTS_FORMAT, "artifact": str(directory), "method": manifest.method, "version": manifest.version,
        "base_model_sha256": manifest.base_model_ref().sha256, "weights_sha256": weights_sha256(directory, manifest),
        "kind": kind, "offset": offset, "max_tokens": max_tokens, **(extra or {}),
        "streams": {name: {"labels": [int(y) for y in s["labels"]], "probs": rnd(s["probs"]),
                           "alpha": rnd(s.get("alpha")), "sigma": rnd(s.get("sigma")),
                           **({"device": s["device"]} if "device" in s else {})} for name, s in streams.items()},
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    return path


_SECRET_OPTION = re.compile(r"\b((?:ssl)?password)\s*=\s*('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)
_URI = re.compile(r"postgres(?:ql)?://\S+")


def without_password(text: str | None) -> str | None:
    """``text`` with every PostgreSQL DSN in it reduced to host, port and database
    (ibedl.engine.feedback_postgres.redacted): ``text`` itself when it is a DSN (a URI or a libpq ``key=value``
    string), every postgresql:// URI inside it, and any ``password=`` / ``sslpassword=`` option left in it (a
    ``key=value`` DSN inside a command line). What the manifest records of a --path that is the service's
    IBEDL_FEEDBACK_DSN, and what messages show. Anything else as it is."""
    if text is None:
        return None
    if is_dsn(text):
        from ibedl.engine.feedback_postgres import redacted

        return redacted(text)
    if "postgres" in text:
        from ibedl.engine.feedback_postgres import redacted

        text = _URI.sub(lambda m: redacted(m.group(0)), text)
    return _SECRET_OPTION.sub(lambda m: f"{m.group(1)}=***", text)


def feedback_outputs(path, manifest: Manifest, minimum: int = 20, from_seq: int | None = None,
                     since_change: bool = False, backend: str | None = None) -> tuple[str, dict, list[int], str]:
    """(kind, raw, labels, calibration key) of the labelled answers of ``manifest``'s adapter version in a feedback
    store (the service's ``IBEDL_FEEDBACK_DB``, a SQLite file, or its ``IBEDL_FEEDBACK_DSN``, a postgresql:// URI):
    the outputs the receipts carried, as served (post-hoc parameter applied); those from store sequence number
    ``from_seq`` on, or with ``since_change`` from the first label of the change that suspended the version's
    promises (the service's change detector: ``suspended.change_seq`` on GET /v1/guarantees; every label of the
    version when its confidence sequence, not a change, showed the promise broken). The labels the store keeps:
    those past its retention (IBEDL_FEEDBACK_RETENTION_DAYS) are gone.

    A guarantee holds for the arithmetic that computed the outputs, so only the answers of one calibration are
    taken (each receipt names the backend and precision that answered): one of ``backend``'s (a backend name), else
    the one most answers name. Labels of receipts that name none (signed before they did) count only in a store
    where none does, as the manifest's top-level calibration's."""
    from ibedl.engine.errors import EngineError

    where = f"the PostgreSQL store at {without_password(str(path))}" if is_dsn(path) else str(path)
    try:
        store = open_store_at(path, 30.0)
        try:
            if since_change:
                from_seq = change_seq(store, manifest, where)
            rows = store.labelled(manifest.name, str(manifest.version), from_seq or 0)
        finally:
            store.close()
    except EngineError as e:  # a store that did not answer: its message names no secret
        raise ValueError(f"the feedback store did not answer: {e.message}") from None
    since = f" from label {from_seq} on" if from_seq else ""
    rows, key = of_one_calibration(rows, backend, manifest.calibrated_on)
    if len(rows) < minimum:
        raise ValueError(f"{where} holds {len(rows)} labels of adapter {manifest.name!r} version {manifest.version}"
                         f"{since} answered on {key}; calibrating needs at least {minimum} (the more, the tighter "
                         "the guarantees)")
    log.info("calibrating on %d labels of adapter %s version %s%s, answered on %s", len(rows), manifest.name,
             manifest.version, since, key)
    probs = [json.loads(r["probs"]) for r in rows]
    alphas = [None if r["alpha"] is None else json.loads(r["alpha"]) for r in rows]
    raw = {"probs": probs, "offset": manifest.head_config().offset, "sigma": None}
    if all(a is not None for a in alphas):
        raw["alpha"] = alphas
        kind = "evidential"  # a Dirichlet whose post-hoc shift is already applied
    else:
        kind = "softmax"
    return kind, raw, [int(r["label"]) for r in rows], key


def of_one_calibration(rows: list[dict], backend: str | None, top_level: str) -> tuple[list[dict], str]:
    """(the rows answered under one calibration, its key): the key of ``backend`` (a backend name: the keys it owns,
    ``Backend.owns_key``) they name, else the key most rows name; rows that name none (receipts signed before they
    did) only when no row names one, as ``top_level``'s. ValueError when they name several keys of ``backend``."""
    owns = None if backend is None else get(backend).owns_key
    named = Counter(r.get("calibration") for r in rows if r.get("calibration"))
    if not named:
        if owns is not None and not owns(top_level):
            log.warning("the labelled receipts do not record the backend that answered them; taking them as %s's, "
                        "the manifest's top-level calibration", top_level)
        return rows, top_level
    if owns is None:
        key = named.most_common(1)[0][0]
    else:
        matches = sorted(k for k in named if owns(k))
        if len(matches) > 1:
            raise ValueError(f"the labelled answers were served on {matches}: name one with --backend")
        key = matches[0] if matches else backend
    kept = [r for r in rows if r.get("calibration") == key]
    if len(kept) < len(rows):
        log.warning("taking the %d labels answered on %s; %d answered on other backends (%s) or unrecorded are left "
                    "out: a calibration holds for the arithmetic it was made on", len(kept), key, len(rows) - len(kept),
                    ", ".join(f"{k}: {n}" for k, n in named.items() if k != key) or "none")
    return kept, key


def change_seq(store, manifest: Manifest, where: str) -> int:
    """The store sequence number from which the labels of ``manifest``'s version show the change that suspended its
    promises (0: every label, when its confidence sequence showed them broken since the start); ValueError when its
    promises were not suspended."""
    from ibedl.engine.feedback import SUSPENDED

    state = store.state((manifest.name, str(manifest.version), SUSPENDED))
    if state is None:
        raise ValueError(f"{where} records no suspension of adapter {manifest.name!r} version {manifest.version} "
                         "(no change detected, no promise shown broken, or the service has not checkpointed it yet: "
                         "GET /v1/guarantees shows suspended); calibrate on every label without --since-change, or "
                         "from a label on with --from-seq")
    return int(json.loads(state).get("change_seq") or 0)


def read_outputs(path, stream: str, directory: Path, manifest: Manifest) -> tuple[str, dict, list[int]]:
    """(kind, raw, labels) of ``stream`` in a raw-outputs file; refuses outputs of other weights."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from e
    if not isinstance(data, dict) or data.get("format") != OUTPUTS_FORMAT:
        raise ValueError(f"{path} is not a raw-outputs file ({OUTPUTS_FORMAT})")
    if data["weights_sha256"] != weights_sha256(directory, manifest) or \
            data["base_model_sha256"] != manifest.base_model_ref().sha256:
        raise ValueError(f"{path} holds outputs of other weights than {directory}: answer the data again")
    if stream not in data["streams"]:
        raise ValueError(f"{path} has no stream {stream!r}; it has {sorted(data['streams'])}")
    s = data["streams"][stream]
    raw = {"probs": s["probs"], "alpha": s.get("alpha"), "sigma": s.get("sigma"), "offset": data["offset"]}
    return data["kind"], raw, s["labels"]


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["CalibrationConfig", "Outputs", "calibrate_outputs", "posthoc_outputs", "save_outputs", "read_outputs",
           "calibrate_predictor", "apply_sections", "gate_threshold", "split", "raw_outputs", "served_outputs"]
