"""Building answers from predictions: the abstention decision and conformal set of each answer, the
metrics, drift and accuracy-estimate bookkeeping it feeds, and the model card and drift status."""

from __future__ import annotations

from evidential.conformal import prediction_set
from evidential.predictor import Prediction
from evidential.prompt import LETTERS, MCQuestion
from service import abstention
from service.requests import conformal_quantile, max_options
from service.schemas import DriftStatus, PredictedOption, PredictRequest, PredictResponse
from service.state import ServiceState


def r6(value) -> float:
    """Responses carry 6 decimals."""
    return round(float(value), 6)


def record(state: ServiceState, pred: Prediction, reason: str | None) -> None:
    """Count a served answer in the metrics; an answered one feeds the accuracy estimate; every one feeds drift."""
    m = state.metrics
    m.answers.inc()
    m.confidence.observe(pred.confidence)
    m.predictions.labels(letter=pred.letter).inc()
    if pred.uncertainty is not None:
        m.uncertainty.observe(pred.uncertainty)
    if reason:
        m.abstentions.labels(reason=reason).inc()
    else:
        state.accuracy.add([pred.confidence])
    state.drift.add([pred.uncertainty if state.drift.statistic == "uncertainty_mass" else pred.confidence])


def respond(state: ServiceState, req: PredictRequest, q: MCQuestion, pred: Prediction,
            request_id: str) -> PredictResponse:
    """The answer to one question: the prediction, its abstention decision and conformal set, recorded."""
    assert state.thresholds is not None and state.adapter is not None
    opts = req.abstain
    limits = abstention.effective(
        state.thresholds,
        opts.max_uncertainty if opts else None,
        opts.min_confidence if opts else None,
    )
    reason = abstention.decide(pred.uncertainty, pred.confidence, limits)
    letters = LETTERS[: q.num_options]
    conformal = conformal_quantile(state.conformal, req)
    pset = None if conformal is None else [letters[i] for i in prediction_set(pred.probs, conformal[0], conformal[2])]
    record(state, pred, reason)
    return PredictResponse(
        id=req.id or request_id,
        prediction=PredictedOption(letter=pred.letter, index=pred.index, text=q.options[pred.index]),
        probabilities={k: r6(v) for k, v in zip(letters, pred.probs)},
        belief_masses=None if pred.belief is None else {k: r6(v) for k, v in zip(letters, pred.belief)},
        uncertainty_mass=None if pred.uncertainty is None else r6(pred.uncertainty),
        confidence=r6(pred.confidence),
        sigma=None if pred.sigma is None else {k: r6(v) for k, v in zip(letters, pred.sigma)},
        ood_score=r6(abstention.ood_score(pred.uncertainty, pred.confidence, limits.ood_score)),
        prediction_set=pset,
        prediction_set_coverage=None if conformal is None else r6(1.0 - conformal[1]),
        prediction_set_score=None if conformal is None else conformal[2],
        abstained=reason is not None,
        abstain_reason=reason,
        adapter=state.adapter,
    )


def model_card(state: ServiceState) -> dict:
    """What /v1/models says of the served adapter."""
    settings, m, c = state.settings, state.predictor.manifest, state.conformal
    head = m.head_config()
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
        "abstention": m.abstention,
        "conformal": None if c is None else {
            "alpha": c.alpha, "score": c.score, "n": c.n, "alphas": c.alphas(), "scores": sorted(c.quantiles)},
        "calibration": m.calibration or None,
        "prompt": {**m.prompt, "training_max_tokens": m.prompt_config().max_tokens, "max_tokens": settings.max_tokens},
        "max_options": max_options(state),
        "head": {"kind": head.kind, "inference": head.inference, "zeta": head.zeta, "temperature": head.temperature,
                 "offset": head.offset},
        "drift_statistic": state.drift.statistic,
    }


def drift_status(state: ServiceState) -> DriftStatus:
    """The drift monitor's and the accuracy estimate's status, also set on their gauges."""
    status = state.drift.status()
    accuracy = state.accuracy.status()
    state.metrics.set_drift(status)
    state.metrics.set_accuracy(accuracy)
    return DriftStatus(**status, **accuracy)
