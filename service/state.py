"""The long-lived objects of one app (``app.state.service``): the predictor and its batcher, drift
monitor, accuracy estimate and metrics; loading, health and shutdown. Routes get it through ``State``."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import math
import re
import time
from typing import Annotated, Callable

import torch
from fastapi import Depends, Request

from evidential.artifact import Abstention, Conformal
from evidential.predictor import Prediction, Predictor, count_prompt_tokens
from evidential.prompt import MCQuestion
from service.batcher import DeadlineExceeded, MicroBatcher, Overloaded, QueueFullError, ShuttingDown, TooLarge
from service.capacity import ServiceTime
from service.drift import AccuracyEstimate, DriftMonitor
from service.errors import ApiError
from service.metrics import Metrics
from service.schemas import Health
from service.settings import Settings

log = logging.getLogger("service")

Loader = Callable[[Settings], Predictor]
TIMEOUT_HEADER = "X-Request-Timeout"


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
        self._watcher: asyncio.Task | None = None

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
            bad = await asyncio.to_thread(nonfinite_weights, predictor)
            if bad:
                raise ValueError(f"{len(bad)} weight tensors hold NaN or inf (first: {', '.join(bad[:3])}); "
                                 "the artifact is broken: retrain or restore it")
            # Served prompts may be longer than the training cut (manifest prompt.max_tokens): the model reads
            # them whole; only what exceeds this limit is refused.
            predictor.max_tokens = self.settings.max_tokens
            service_time = await asyncio.to_thread(warm_up, predictor)
        except Exception as e:  # a broken artifact must not kill the process: readiness reports it
            log.exception("loading the adapter failed")  # the log keeps the server's paths; clients do not see them
            self.status, self.reason = "failed", redact_paths(f"{type(e).__name__}: {e}")
            return
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
            max_batch_tokens=self.settings.max_batch_tokens,
            service_time=service_time,
            margin=self.settings.admission_margin,
        )
        self.batcher.start()
        self.metrics.seconds_per_token.set(service_time.per_token_s)
        self._watcher = asyncio.get_running_loop().create_task(self._watch_shutdown(), name="shutdown-watcher")
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

    def begin_drain(self) -> None:
        """Stop admitting (readiness 503) and let the batcher answer what can finish within the grace period."""
        if self.status != "draining":
            log.info("shutting down: draining for up to %.0f s", self.settings.shutdown_grace_s)
        self.status, self.reason = "draining", "the service is shutting down"
        self.metrics.ready.set(0)
        if self.batcher is not None:
            self.batcher.begin_drain(self.settings.shutdown_grace_s)

    async def _watch_shutdown(self) -> None:
        """Notice uvicorn's SIGTERM (``server.should_exit``) at once, not at the next readiness probe."""
        while True:
            if self.server is not None and getattr(self.server, "should_exit", False):
                self.begin_drain()
                return
            await asyncio.sleep(0.05)

    async def shutdown(self) -> None:
        self.begin_drain()
        if self._watcher is not None:
            self._watcher.cancel()
        if self.batcher is not None:
            await self.batcher.stop()

    def health(self) -> tuple[int, Health]:
        if self.status == "ready" and self.server is not None and getattr(self.server, "should_exit", False):
            self.begin_drain()
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
        if self.batcher is not None:
            self.metrics.seconds_per_token.set(self.batcher.service_time.per_token_s)

    def _refusal(self, e: Exception, n: int) -> ApiError:
        """The answer to a request the batcher refused (``n`` questions), counted by reason."""
        if isinstance(e, QueueFullError):
            reason, error = "queue_full", ApiError(503, "overloaded", f"too many questions waiting ({e}); retry shortly",
                                                   headers={"Retry-After": "1"})
        elif isinstance(e, Overloaded):
            reason, error = "capacity", ApiError(503, "overloaded", f"{e}; retry after the Retry-After seconds",
                                                 headers={"Retry-After": str(max(1, math.ceil(e.retry_after)))})
        elif isinstance(e, TooLarge):
            reason, error = "too_large", ApiError(413, "too_large", str(e), "items" if n > 1 else None)
        elif isinstance(e, ShuttingDown):
            reason, error = "shutting_down", ApiError(503, "shutting_down", str(e), headers={"Retry-After": "1"})
        else:
            reason, error = "timeout", ApiError(504, "timeout", str(e))
        self.metrics.rejected.labels(reason=reason).inc(n)
        return error

    def deadline(self, request: Request) -> float:
        """``time.monotonic()`` by which ``request`` must be answered: from its arrival, the server's
        request timeout or the shorter ``X-Request-Timeout`` (seconds) the client sent."""
        limit = self.settings.request_timeout_s
        given = request.headers.get(TIMEOUT_HEADER)
        if given is not None:
            try:
                seconds = float(given)
            except ValueError:
                seconds = float("nan")
            if not (seconds > 0 and math.isfinite(seconds)):
                raise ApiError(422, "invalid_request", f"{TIMEOUT_HEADER} must be a positive number of seconds, "
                               f"got {given[:40]!r}", TIMEOUT_HEADER)
            limit = min(limit, seconds)
        arrived = request.scope.get("state", {}).get("arrived", time.monotonic())
        return arrived + limit

    async def answer(self, questions: list[MCQuestion], tokens: list[int], request: Request) -> list[Prediction]:
        """The model's predictions for one request's ``questions`` (``tokens``: prompt tokens of each).

        Refused at once with 503 + Retry-After when they cannot be answered before the request's deadline
        (or the service is draining), 413 when they could not be even on an idle model; a client that goes
        away takes its queued questions with it; 503 model_error when the model's numbers are not finite.
        """
        assert self.batcher is not None
        deadline = self.deadline(request)
        rejected = self.metrics.rejected
        try:
            admitted = request.scope.get("state", {}).get("admitted", False)
            futures = await self.batcher.submit_many(questions, tokens, deadline, admitted_before_drain=admitted)
        except TooLarge as e:
            if deadline < request.scope.get("state", {}).get("arrived", 0.0) + self.settings.request_timeout_s:
                # the client's X-Request-Timeout is what cannot be met, not the request's size
                self.metrics.rejected.labels(reason="timeout").inc(len(questions))
                raise ApiError(504, "timeout", f"{str(e).split(';')[0]}; its {TIMEOUT_HEADER} cannot be met") from e
            raise self._refusal(e, len(questions)) from e
        except (QueueFullError, Overloaded, ShuttingDown) as e:
            raise self._refusal(e, len(questions)) from e
        everything = asyncio.gather(*futures)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({everything, gone}, timeout=max(0.0, deadline - time.monotonic()),
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if everything not in done:
            everything.cancel()
            for f in futures:
                f.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await everything
            if gone in done:
                rejected.labels(reason="client_gone").inc(len(questions))
                raise ApiError(499, "client_closed_request", "the client went away before the answer")
            rejected.labels(reason="timeout").inc(len(questions))
            raise ApiError(504, "timeout", "no answer before the request's deadline; the service is busy")
        try:
            preds = list(everything.result())
        except (Overloaded, ShuttingDown, DeadlineExceeded) as e:  # refused after admission, before its pass
            raise self._refusal(e, len(questions)) from e
        broken = [i for i, p in enumerate(preds) if not finite_prediction(p)]
        if broken:
            self.metrics.nonfinite.inc(len(broken))
            log.error("the model gave non-finite numbers for %d of %d questions (request %s); not answered",
                      len(broken), len(preds), request.scope.get("state", {}).get("request_id"))
            raise ApiError(503, "model_error", "the model produced non-finite numbers for "
                           + (f"items {broken}" if len(preds) > 1 else "this question") + "; it was not answered")
        return preds


PROBE = MCQuestion(  # short question and options: its passage is cut to fit any served token limit
    "Which one?",
    ("this", "that", "neither", "both"),
    " ".join(["The service times one forward pass of a question of typical length before it reports ready."] * 8),
)


def warm_up(predictor: Predictor) -> ServiceTime:
    """Time the model on one question of typical length (the second of two passes: the first pays one-time
    costs), as the first estimate of seconds per prompt token; every served pass refines it."""
    tokens = min(count_prompt_tokens(predictor.tokenizer, predictor.template, PROBE), predictor.max_tokens)
    predictor.predict([PROBE])  # its passage is cut to the served limit
    start = time.perf_counter()
    predictor.predict([PROBE])
    return ServiceTime((time.perf_counter() - start) / tokens)


_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[/\\][^\s/\\'\"():,]+)+[/\\]([^\s/\\'\"():,]+)")


def redact_paths(message: str) -> str:
    """``message`` with every file path cut to its last part: clients learn which file, not where it lives."""
    return _PATH.sub(r"\1", message)


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def finite_prediction(p: Prediction) -> bool:
    """Every number of a prediction is finite (a NaN or inf must never become an answer)."""
    values = [p.confidence, *p.probs, *(p.alpha or ()), *(p.belief or ()), *(p.sigma or ())]
    if p.uncertainty is not None:
        values.append(p.uncertainty)
    return all(math.isfinite(v) for v in values)


def nonfinite_weights(predictor: Predictor) -> list[str]:
    """Names of the predictor's parameters and buffers (base, adapter and heads) that hold a NaN or inf."""
    bad = []
    modules = [("model", predictor.model)] + [(f"head{i}", h) for i, h in enumerate(predictor.heads)]
    for prefix, module in modules:
        if not isinstance(module, torch.nn.Module):
            continue
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                bad.append(f"{prefix}.{name}")
    return bad


def get_state(request: Request) -> ServiceState:
    return request.app.state.service


State = Annotated[ServiceState, Depends(get_state)]
