"""The long-lived objects of one app (``app.state.service``): the predictor and its batcher, drift
monitor, accuracy estimate and metrics; loading, health and shutdown. Routes get it through ``State``."""

from __future__ import annotations

import asyncio
import copy
import logging
from typing import Annotated, Callable

import torch
from fastapi import Depends, Request

from evidential.artifact import Abstention, Conformal
from evidential.predictor import Prediction, Predictor
from evidential.prompt import MCQuestion
from service.batcher import MicroBatcher, QueueFullError
from service.drift import AccuracyEstimate, DriftMonitor
from service.errors import ApiError
from service.metrics import Metrics
from service.schemas import Health
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
        self.count_tokenizer = None  # a copy for the event loop: the worker thread owns the predictor's

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
        self.count_tokenizer = copy.deepcopy(predictor.tokenizer)
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
        base = manifest.base_model_ref()
        self.metrics.model_info.info(
            {"adapter": manifest.name, "version": str(manifest.version), "method": manifest.method,
             "base_model": base.name, "base_sha256": base.sha256[:12]}
        )
        self.metrics.set_drift(drift.status())
        self.metrics.set_accuracy(self.accuracy.status())
        self.status, self.reason = "ready", None
        self.metrics.ready.set(1)
        log.info("serving adapter %s (%s) on %s", manifest.name, manifest.method, base.name)

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

    def accepting(self) -> bool:
        """Whether a request arriving now is admitted: the model is loaded and no shutdown has begun."""
        return self.health()[0] == 200

    def require_ready(self, request: Request) -> None:
        """Refuse (503 not_ready + Retry-After) unless the model can answer this request. Admission is decided
        once, when the request arrives (RequestGuard sets ``admitted``): one that arrived before SIGTERM is
        answered while the batcher drains; one that arrives after it is refused, so a gateway retries it on
        another replica."""
        code, health = self.health()
        if code == 200:
            return
        admitted = request.scope.get("state", {}).get("admitted", False)
        if not (admitted and self.status == "draining" and self.batcher is not None and self.batcher.running):
            raise ApiError(503, "not_ready", f"the service is {health.status}: {health.reason}", headers={"Retry-After": "5"})

    # -- batching -------------------------------------------------------------------------------

    def _predict_batch(self, questions: list[MCQuestion]) -> list[Prediction]:
        assert self.predictor is not None
        return self.predictor.predict(questions, truncate_context=False)

    def _on_batch(self, size: int, seconds: float) -> None:
        self.metrics.batch_size.observe(size)
        self.metrics.forward_seconds.observe(seconds)

    async def answer(self, questions: list[MCQuestion]) -> list[Prediction]:
        """The model's predictions for ``questions``, through the batch queue; 503 when it is full, 504 on timeout."""
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
