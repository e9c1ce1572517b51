"""Building answers from predictions, one pure function shared by the service and the Python API (``ibedl``):
the abstention decision and conformal set of each answer, and the model card. Nothing here records metrics or
drift (the service's observer does: ``ibedl.serve.observer``) or imports FastAPI."""

from __future__ import annotations

from dataclasses import asdict

from ibedl.core.conformal import prediction_set
from ibedl.core.predictor import Prediction
from ibedl.core.prompt import LETTERS, MCQuestion
from ibedl.engine import abstention
from ibedl.engine.feedback import Feedback
from ibedl.engine.requests import conformal_of, max_options, stored_quantile
from ibedl.engine.runtime import AdapterRuntime
from ibedl.engine.schemas import PredictedOption, PredictRequest, PredictResponse, StatedGuarantees
from ibedl.engine.settings import EngineSettings


def r6(value) -> float:
    """Responses carry 6 decimals."""
    return round(float(value), 6)


def build_answer(runtime: AdapterRuntime, req: PredictRequest, q: MCQuestion, pred: Prediction,
                 answer_id: str, feedback: Feedback | None = None) -> PredictResponse:
    """The answer to one question by the adapter ``runtime``: the prediction, its abstention decision and
    conformal set; ``answer_id`` when the request carries no ``id``. With ``feedback`` (on), the answer carries its
    signed receipt and, when adaptive sets are on, its adaptive set."""
    opts = req.abstain
    own = runtime.thresholds.for_options(q.num_options)  # its option count's, when calibrated per count
    limits = abstention.effective(
        own,
        opts.max_uncertainty if opts else None,
        opts.min_confidence if opts else None,
    )
    reason = abstention.decide(pred.uncertainty, pred.confidence, limits)
    # Thresholds of the request's own answer other questions than those the calibration certified (Learn-then-Test
    # tests the adapter's threshold, and answered accuracy need not rise with a higher one): no accuracy is promised.
    own_rule = limits.min_confidence == own.min_confidence and (
        not runtime.dirichlet or limits.max_uncertainty == own.max_uncertainty)  # no Dirichlet: no u to abstain on
    letters = LETTERS[: q.num_options]
    conformal = stored_quantile(conformal_of(runtime, q.num_options), req)
    set_indices = None if conformal is None else prediction_set(pred.probs, conformal[0], conformal[2])
    pset = None if set_indices is None else [letters[i] for i in set_indices]
    guarantees = stated_guarantees(runtime, own, q.num_options, None if conformal is None else conformal[1],
                                   None if feedback is None else feedback.suspension(runtime), own_rule)
    adaptive = receipt = None
    if feedback is not None and feedback.enabled:
        adaptive = feedback.adaptive_set(runtime, pred.probs)
        receipt = feedback.receipt(runtime, req.id or answer_id, pred, reason is None, set_indices,
                                   None if conformal is None else r6(1.0 - conformal[1]), adaptive, own_rule)
    return PredictResponse(
        id=req.id or answer_id,
        prediction=PredictedOption(letter=pred.letter, index=pred.index, text=q.options[pred.index]),
        probabilities={k: r6(v) for k, v in zip(letters, pred.probs, strict=True)},
        belief_masses=None if pred.belief is None else {k: r6(v) for k, v in zip(letters, pred.belief, strict=True)},
        uncertainty_mass=None if pred.uncertainty is None else r6(pred.uncertainty),
        confidence=r6(pred.confidence),
        sigma=None if pred.sigma is None else {k: r6(v) for k, v in zip(letters, pred.sigma, strict=True)},
        ood_score=r6(abstention.ood_score(pred.uncertainty, pred.confidence, limits.ood_score)),
        prediction_set=pset,
        prediction_set_coverage=None if conformal is None or guarantees.holds is False else r6(1.0 - conformal[1]),
        prediction_set_score=None if conformal is None else conformal[2],
        abstained=reason is not None,
        abstain_reason=reason,
        adapter=runtime.ref,
        adaptive_prediction_set=None if adaptive is None else [letters[i] for i in adaptive or [pred.index]],
        receipt=receipt,
        guarantees=guarantees,
    )


def stated_guarantees(runtime: AdapterRuntime, thresholds, options: int, alpha: float | None,
                      suspended: dict | None = None, own_rule: bool = True) -> StatedGuarantees:
    """What the calibration in use promises for an answer to a question of ``options`` options under
    ``thresholds`` (that count's) whose set has miscoverage ``alpha`` (None: no set); no answered accuracy when the
    request chose its own thresholds (not ``own_rule``); nothing, with the reason,
    for a count the calibration does not claim or while labelled feedback has the version's promises
    ``suspended`` (``{"since": ISO 8601}``: ibedl.engine.feedback.Feedback.suspension)."""
    how, counts = thresholds.how, runtime.option_counts
    reason = ("option_count_not_calibrated" if counts is not None and options not in counts
              else "violated_by_feedback" if suspended is not None else None)
    if reason is not None:
        return StatedGuarantees(holds=False, reason=reason, since=None if suspended is None or reason !=
                                "violated_by_feedback" else suspended["since"], option_counts=counts,
                                answered_accuracy=None, answered_accuracy_delta=None, set_coverage=None,
                                set_coverage_delta=None)
    target = thresholds.stated_target if own_rule else None
    gate = thresholds.ood_threshold > 0 and how.get("gate_rejection_rate") is not None
    return StatedGuarantees(
        holds=None if counts is None else True,
        option_counts=counts,
        answered_accuracy=target,
        answered_accuracy_delta=None if target is None else how.get("delta"),
        set_coverage=None if alpha is None else r6(1.0 - alpha),
        set_coverage_delta=None if alpha is None else runtime.conformal.delta,
        gate_refusal_rate=how.get("gate_rejection_rate") if gate else None,
        gate_refusal_delta=how.get("delta") if gate else None,
    )


def measured(choice) -> dict | None:
    """What ``auto`` measured (ibedl.core.auto_backend.AutoChoice) as served, without the cache file's path."""
    from ibedl.core.auto_backend import TIMING_QUESTIONS

    if choice is None:
        return None
    return {"batch": TIMING_QUESTIONS, "seconds": {k: r6(v) for k, v in choice.seconds.items()},
            "skipped": choice.skipped, "measured_at": choice.measured, "from_earlier_start": choice.cached}


def forwards(trunk) -> dict | None:
    """How a trunk that counts its forwards ran them (a graphed CUDA trunk: graphs ``captured``, ``replays``,
    ``eager`` and ``masked`` forwards without a graph: ibedl.core.backends.cuda_graphs), None for any other."""
    counts = getattr(trunk, "counts", None)
    if counts is None:
        return None
    return {key: int(counts.get(key, 0)) for key in ("captured", "replays", "eager", "masked")}


def model_card(runtime: AdapterRuntime, settings: EngineSettings, suspended: dict | None = None) -> dict:
    """What /v1/models says of a served adapter; ``suspended``: why labelled feedback suspended its version's
    promises (ibedl.engine.feedback.Feedback.suspension), None while they stand."""
    m, c, served = runtime.predictor.manifest, runtime.conformal, runtime.calibration
    head = runtime.predictor.head.config  # its post-hoc parameter is the served calibration's
    return {
        "id": m.name,
        "name": m.name,
        "version": str(m.version),
        "method": m.method,
        "method_config": m.method_config,
        "base_model": m.base_model,
        "training_data": m.training.get("data"),
        "label_noise": m.training.get("label_noise"),
        "created": m.training.get("created"),
        "metrics": m.metrics,
        "abstention": asdict(served.thresholds),
        "conformal": None if c is None else {
            "alpha": c.alpha, "score": c.score, "n": c.n, "alphas": c.alphas(), "scores": sorted(c.quantiles),
            "delta": c.delta},
        "calibrated_option_counts": runtime.option_counts,
        "promises_suspended": suspended,
        "calibration": served.record or None,
        "backend": {"name": runtime.predictor.backend, "requested": settings.backend,
                    "reason": runtime.predictor.backend_reason, "measured": measured(runtime.predictor.backend_choice),
                    "forwards": forwards(runtime.predictor.trunk)},
        "calibration_in_use": {"key": served.key, "backend_key": runtime.predictor.calibration_key,
                               "matches_backend": runtime.calibration_matches, "carried": m.calibration_keys(),
                               "metrics": served.metrics},
        "prompt": {**m.prompt, "training_max_tokens": m.prompt_config().max_tokens, "max_tokens": settings.max_tokens},
        "max_options": max_options(settings, runtime),
        "head": {"kind": head.kind, "inference": head.inference, "zeta": head.zeta, "temperature": head.temperature,
                 "offset": head.offset},
        "drift_statistic": runtime.drift_statistic,
    }
