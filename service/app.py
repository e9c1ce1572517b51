"""The app factory: ``create_app(settings)`` builds the FastAPI app; the model loads in the lifespan
(in a thread, so liveness answers at once and readiness says 503 until the adapter is ready)."""

from __future__ import annotations

import asyncio
import copy
import logging
import secrets
from contextlib import asynccontextmanager
from typing import Annotated, Callable

import torch
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from evidential.artifact import Abstention, Conformal
from evidential.conformal import prediction_set
from evidential.predictor import Prediction, Predictor, count_prompt_tokens
from evidential.prompt import LETTERS, MCQuestion
from service import abstention
from service.batcher import MicroBatcher, QueueFullError
from service.drift import AccuracyEstimate, DriftMonitor
from service.errors import ApiError, error_body, install_handlers
from service.metrics import Metrics
from service.middleware import RequestGuard
from service.schemas import (
    BatchRequest,
    BatchResponse,
    DriftStatus,
    ErrorResponse,
    Health,
    ModelList,
    PredictedOption,
    PredictRequest,
    PredictResponse,
)
from service.settings import Settings

log = logging.getLogger("service")

Loader = Callable[[Settings], Predictor]


def load_predictor(settings: Settings) -> Predictor:
    """The default loader: base model + adapter of ``settings.artifact``."""
    if settings.threads:
        torch.set_num_threads(settings.threads)
    return Predictor.from_artifact(
        settings.artifact,
        base_model=settings.base_model,
        device=settings.device,
        load_in_4bit=settings.load_in_4bit,
        allow_base_mismatch=settings.allow_base_mismatch,
        backend=settings.backend,
    )


class ServiceState:
    """Long-lived objects of one app: the predictor, its batcher, drift monitor and metrics."""

    def __init__(self, settings: Settings, loader: Loader) -> None:
        self.settings = settings
        self.loader = loader
        self.metrics = Metrics()
        self.status = "loading"
        self.reason: str | None = "the model is loading"
        self.predictor: Predictor | None = None
        self.thresholds: Abstention | None = None  # the adapter's default abstention thresholds
        self.adapter: dict | None = None  # the "adapter" field of every answer
        self.batcher: MicroBatcher | None = None
        self.drift: DriftMonitor | None = None
        self.conformal: Conformal | None = None  # stored conformal quantiles (None: never calibrated)
        self.accuracy: AccuracyEstimate | None = None
        self.server = None  # uvicorn.Server when run by service.__main__, to notice SIGTERM
        self._count_tokenizer = None

    # -- lifecycle ------------------------------------------------------------------------------

    async def load(self) -> None:
        try:
            predictor = await asyncio.to_thread(self.loader, self.settings)
            manifest = predictor.manifest
            if manifest is None:
                raise ValueError("the loader returned a predictor without a manifest")
            use_u = manifest.reference.get("uncertainty") is not None
            drift = await asyncio.to_thread(
                DriftMonitor,
                manifest.reference.get("uncertainty" if use_u else "confidence"),
                "uncertainty_mass" if use_u else "confidence",
                self.settings.drift_window,
                self.settings.drift_alarm_rate,
                self.settings.drift_bootstrap,
            )
        except Exception as e:  # a broken artifact must not kill the process: readiness reports it
            log.exception("loading the adapter failed")
            self.status, self.reason = "failed", f"{type(e).__name__}: {e}"
            return
        # Served prompts may be longer than the training cut (manifest prompt.max_tokens): the model reads
        # them whole; only what exceeds this limit is refused.
        predictor.max_tokens = self.settings.max_tokens
        self._count_tokenizer = copy.deepcopy(predictor.tokenizer)  # the worker thread owns the original
        self.thresholds = manifest.thresholds()
        self.conformal = manifest.conformal_sets()
        target = self.thresholds.how.get("target_accuracy")
        self.accuracy = AccuracyEstimate(self.settings.drift_window, float(target) if target else None)
        self.adapter = {"name": manifest.name, "method": manifest.method, "version": str(manifest.version)}
        self.predictor, self.drift = predictor, drift
        self.batcher = MicroBatcher(
            self._predict_batch,
            self.settings.max_batch_size,
            self.settings.max_wait_ms,
            self.settings.queue_size,
            on_batch=self._on_batch,
            on_depth=self.metrics.queue_depth.set,
        )
        self.batcher.start()
        self.metrics.model_info.info(
            {"adapter": manifest.name, "version": str(manifest.version), "method": manifest.method,
             "base_model": manifest.base_model["name"], "base_sha256": manifest.base_model["sha256"][:12]}
        )
        self.metrics.set_drift(drift.status())
        self.metrics.set_accuracy(self.accuracy.status())
        self.status, self.reason = "ready", None
        self.metrics.ready.set(1)
        log.info("serving adapter %s (%s) on %s", manifest.name, manifest.method, manifest.base_model["name"])

    async def shutdown(self) -> None:
        self.status, self.reason = "draining", "the service is shutting down"
        self.metrics.ready.set(0)
        if self.batcher is not None:
            await self.batcher.stop()

    def health(self) -> tuple[int, Health]:
        if self.status == "ready" and self.server is not None and getattr(self.server, "should_exit", False):
            self.status, self.reason = "draining", "the service is shutting down"
            self.metrics.ready.set(0)
        if self.status == "ready":
            return 200, Health(status="ready")
        return 503, Health(status=self.status, reason=self.reason)

    def require_ready(self) -> None:
        code, health = self.health()
        if code != 200:
            raise ApiError(503, "not_ready", f"the service is {health.status}: {health.reason}", headers={"Retry-After": "5"})

    # -- prediction -----------------------------------------------------------------------------

    def _predict_batch(self, questions: list[MCQuestion]) -> list[Prediction]:
        assert self.predictor is not None
        return self.predictor.predict(questions, truncate_context=False)

    def _on_batch(self, size: int, seconds: float) -> None:
        self.metrics.batch_size.observe(size)
        self.metrics.forward_seconds.observe(seconds)

    def to_question(self, req: PredictRequest, prefix: str = "") -> MCQuestion:
        """Check limits and convert; raises ApiError (422 invalid, 413 too large) naming the field."""
        s = self.settings
        if isinstance(req.options, dict):
            keys = list(req.options)
            expected = list(LETTERS[: len(keys)])
            if sorted(keys) != expected:
                raise ApiError(422, "invalid_request", f"option letters must be consecutive from A, got {keys}", prefix + "options")
            options = [req.options[k] for k in expected]
        else:
            options = list(req.options)
        max_options = min(s.max_options, self.predictor.num_rows if self.predictor else s.max_options)
        if not 2 <= len(options) <= max_options:
            raise ApiError(422, "invalid_request", f"a question needs 2..{max_options} options, got {len(options)}", prefix + "options")
        if not req.question.strip():
            raise ApiError(422, "invalid_request", "question must not be blank", prefix + "question")
        if len(req.question) > s.max_question_chars:
            raise ApiError(413, "too_large", f"question is {len(req.question)} characters; the limit is {s.max_question_chars}", prefix + "question")
        for i, text in enumerate(options):
            if not text.strip():
                raise ApiError(422, "invalid_request", f"option {LETTERS[i]} must not be blank", f"{prefix}options.{i}")
            if len(text) > s.max_option_chars:
                raise ApiError(413, "too_large", f"option {LETTERS[i]} is {len(text)} characters; the limit is {s.max_option_chars}", f"{prefix}options.{i}")
        if req.context is not None and len(req.context) > s.max_context_chars:
            raise ApiError(413, "too_large", f"context is {len(req.context)} characters; the limit is {s.max_context_chars}", prefix + "context")
        if req.conformal is not None:
            self.conformal_quantile(req, prefix)  # an alpha or score not stored is the client's error: 422
        q = MCQuestion(req.question, tuple(options), req.context or None, id=req.id)
        tokens = self.count_tokens(q)
        if tokens > self.settings.max_tokens:
            raise ApiError(413, "too_large", f"the prompt is {tokens} tokens after formatting; the limit is {self.settings.max_tokens}",
                           prefix + ("context" if q.context else "question"))
        return q

    def conformal_quantile(self, req: PredictRequest, prefix: str = "") -> tuple[float, float, str] | None:
        """(quantile, alpha, score) of the set a request gets; None when the adapter has no conformal calibration."""
        c = self.conformal
        opts = req.conformal
        if c is None:
            if opts is not None and (opts.alpha is not None or opts.score is not None):
                raise ApiError(422, "invalid_request", "this adapter has no conformal calibration; run "
                               "python -m training.calibrate on it to get prediction sets", prefix + "conformal")
            return None
        alpha = opts.alpha if opts and opts.alpha is not None else c.alpha
        score = opts.score if opts and opts.score is not None else c.score
        try:
            return c.quantile(alpha, score), alpha, score
        except (KeyError, ValueError):
            raise ApiError(422, "invalid_request", f"no stored prediction set for alpha {alpha} and score {score!r}; "
                           f"stored alphas: {c.alphas()}, scores: {sorted(c.quantiles)}",
                           prefix + "conformal") from None

    def count_tokens(self, q: MCQuestion) -> int:
        assert self.predictor is not None
        return count_prompt_tokens(self._count_tokenizer, self.predictor.template, q)

    def respond(self, req: PredictRequest, q: MCQuestion, pred: Prediction, request_id: str) -> PredictResponse:
        assert self.thresholds is not None and self.adapter is not None
        opts = req.abstain
        limits = abstention.effective(
            self.thresholds,
            opts.max_uncertainty if opts else None,
            opts.min_confidence if opts else None,
        )
        reason = abstention.decide(pred.uncertainty, pred.confidence, limits)
        letters = LETTERS[: q.num_options]
        conformal = self.conformal_quantile(req)
        pset = None if conformal is None else [letters[i] for i in prediction_set(pred.probs, conformal[0], conformal[2])]
        r6 = lambda v: round(float(v), 6)  # noqa: E731 - responses carry 6 decimals
        m = self.metrics
        m.answers.inc()
        m.confidence.observe(pred.confidence)
        m.predictions.labels(letter=pred.letter).inc()
        if pred.uncertainty is not None:
            m.uncertainty.observe(pred.uncertainty)
        if reason:
            m.abstentions.labels(reason=reason).inc()
        else:
            self.accuracy.add([pred.confidence])
        self.drift.add([pred.uncertainty if self.drift.statistic == "uncertainty_mass" else pred.confidence])
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
            adapter=self.adapter,
        )

    async def answer(self, questions: list[MCQuestion]) -> list[Prediction]:
        assert self.batcher is not None
        try:
            futures = await self.batcher.submit_many(questions)
        except QueueFullError as e:
            self.metrics.rejected.labels(reason="queue_full").inc(len(questions))
            raise ApiError(503, "overloaded", f"too many questions waiting ({e}); retry shortly", headers={"Retry-After": "1"}) from e
        try:
            return list(await asyncio.wait_for(asyncio.gather(*futures), self.settings.request_timeout_s))
        except (asyncio.TimeoutError, TimeoutError) as e:
            for f in futures:
                f.cancel()
            self.metrics.rejected.labels(reason="timeout").inc(len(questions))
            raise ApiError(504, "timeout", f"no answer within {self.settings.request_timeout_s} s; the service is busy") from e


def get_state(request: Request) -> ServiceState:
    return request.app.state.service


State = Annotated[ServiceState, Depends(get_state)]


def create_app(settings: Settings | None = None, loader: Loader | None = None) -> FastAPI:
    """Build the app. ``loader`` (default: the artifact of ``settings``) lets tests inject a predictor."""
    settings = settings or Settings()
    state = ServiceState(settings, loader or load_predictor)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(state.load(), name="load-model")
        try:
            yield
        finally:
            if not task.done():
                task.cancel()
            await state.shutdown()

    app = FastAPI(
        title="IB-EDL multiple-choice service",
        version="1.0",
        description="Answers multiple-choice questions with expected probabilities, Dirichlet belief masses, "
        "an uncertainty mass and an abstention decision.",
        lifespan=lifespan,
        responses={422: {"model": ErrorResponse}, 503: {"model": ErrorResponse}},
    )
    app.state.service = state
    install_handlers(app)
    app.add_middleware(RequestGuard, state=state)

    def authorised(request: Request) -> None:
        token = settings.api_token.get_secret_value() if settings.api_token else None
        if not token:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), token.encode()):
            raise ApiError(401, "unauthorized", "a valid 'Authorization: Bearer <token>' header is required",
                           headers={"WWW-Authenticate": "Bearer"})

    Auth = Depends(authorised)
    errors = {401: {"model": ErrorResponse}, 413: {"model": ErrorResponse}, 415: {"model": ErrorResponse},
              504: {"model": ErrorResponse}}

    @app.get("/health/live", response_model=Health, tags=["health"])
    async def live() -> Health:
        return Health(status="alive")

    @app.get("/health/ready", response_model=Health, tags=["health"], responses={503: {"model": Health}})
    async def ready(state: State):
        code, health = state.health()
        return JSONResponse(health.model_dump(), status_code=code)

    @app.post("/predict", response_model=PredictResponse, dependencies=[Auth], responses=errors, tags=["predict"])
    async def predict(body: PredictRequest, request: Request, state: State) -> PredictResponse:
        state.require_ready()
        q = state.to_question(body)
        (pred,) = await state.answer([q])
        return state.respond(body, q, pred, request.state.request_id)

    @app.post("/predict/batch", response_model=BatchResponse, dependencies=[Auth], responses=errors, tags=["predict"])
    async def predict_batch(body: BatchRequest, request: Request, state: State) -> BatchResponse:
        state.require_ready()
        if len(body.items) > settings.max_batch_items:
            raise ApiError(413, "too_large", f"{len(body.items)} items; the limit is {settings.max_batch_items}", "items")
        questions = [state.to_question(item, f"items.{i}.") for i, item in enumerate(body.items)]
        preds = await state.answer(questions)
        rid = request.state.request_id
        return BatchResponse(results=[state.respond(item, q, p, f"{rid}-{i}") for i, (item, q, p) in
                                      enumerate(zip(body.items, questions, preds))])

    @app.get("/v1/models", response_model=ModelList, dependencies=[Auth], tags=["metadata"])
    async def models(state: State) -> dict:
        state.require_ready()
        m = state.predictor.manifest
        head = m.head_config()
        return {
            "data": [{
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
                "conformal": None if state.conformal is None else {
                    "alpha": state.conformal.alpha, "score": state.conformal.score, "n": state.conformal.n,
                    "alphas": state.conformal.alphas(), "scores": sorted(state.conformal.quantiles)},
                "calibration": m.calibration or None,
                "prompt": {**m.prompt, "training_max_tokens": m.prompt.get("max_tokens"), "max_tokens": settings.max_tokens},
                "max_options": min(settings.max_options, head.num_rows),
                "head": {"kind": head.kind, "inference": head.inference, "zeta": head.zeta, "temperature": head.temperature,
                         "offset": head.offset},
                "drift_statistic": state.drift.statistic,
            }]
        }

    @app.get("/v1/drift", response_model=DriftStatus, dependencies=[Auth], tags=["metadata"])
    async def drift(state: State) -> DriftStatus:
        state.require_ready()
        status = state.drift.status()
        accuracy = state.accuracy.status()
        state.metrics.set_drift(status)
        state.metrics.set_accuracy(accuracy)
        return DriftStatus(**status, **accuracy)

    @app.get("/metrics", tags=["metadata"], include_in_schema=False)
    async def metrics(state: State) -> Response:
        if state.drift is not None:
            state.metrics.set_drift(await asyncio.to_thread(state.drift.status))
            state.metrics.set_accuracy(state.accuracy.status())
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


__all__ = ["create_app", "load_predictor", "ServiceState", "error_body"]
