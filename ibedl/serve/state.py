"""The long-lived objects of one app (``app.state.service``): the engine (``ibedl.engine.engine.Engine``: the served
adapters, their scheduler and feedback), what the service adds to it (the metrics, each adapter's drift monitor and
accuracy estimate, the feedback store's thread, the background backend switcher), loading, health and shutdown.
Routes get it through ``State``."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import math
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request

from ibedl.core.predictor import Predictor
from ibedl.engine import errors
from ibedl.engine.admission import TIMEOUT_HEADER, Admission, InvalidTimeout
from ibedl.engine.capacity import warm_up
from ibedl.engine.drift import AccuracyEstimate, DriftMonitor
from ibedl.engine.engine import Checked, Engine
from ibedl.engine.feedback import Feedback, LabelQuota
from ibedl.engine.runtime import (
    AdapterRuntime,
    UncalibratedBackend,
    load_predictors,
    make_runtimes,
    recalibrated,
    switched,
)
from ibedl.engine.schemas import (
    DriftStatus,
    FeedbackRequest,
    FeedbackResponse,
    GuaranteesResponse,
    Health,
    PredictResponse,
)
from ibedl.serve.metrics import Metrics
from ibedl.serve.settings import Settings

log = logging.getLogger("ibedl.serve")

# A loader gives the predictors of the served adapters (the default first); one predictor for one adapter.
Loader = Callable[[Settings], "list[Predictor] | Predictor"]
# A feedback call is at most a connect, the label's write, a read and a checkpoint, each waiting up to
# IBEDL_FEEDBACK_TIMEOUT_S for the store: a request waits this many timeouts for its call, then 503 store_unavailable.
STORE_WAITS = 4
METRICS_STORE_WAIT_S = 1.0  # /metrics waits this long for the store's guarantees, then serves the gauges as they are
STORE_RETRY_S = 2.0  # while loading, a store that does not answer (yet) is tried again this often


def load_predictor(settings: Settings) -> Predictor:
    """The predictor of the one adapter of ``settings`` (tests wrap it to slow or break the model)."""
    predictors = load_predictors(settings)
    if len(predictors) != 1:
        raise ValueError(f"load_predictor loads one adapter; settings name {len(predictors)}: use load_predictors")
    return predictors[0]


class ServiceState:
    """Long-lived objects of one app: the adapters' runtimes, the batcher they share, the metrics."""

    def __init__(self, settings: Settings, loader: Loader) -> None:
        self.settings = settings
        self.loader = loader
        self.metrics = Metrics()
        self.admission = Admission(settings.request_timeout_s, settings.admission_margin)  # the engine's, once loaded
        self.engine_settings = settings.engine()  # the engine's part of the settings, derived once
        self.feedback = Feedback(self.engine_settings)  # receipts out, labels in (IBEDL_FEEDBACK_DB or _DSN)
        self.status = "loading"
        self.reason: str | None = "the model is loading"
        self.engine: Engine | None = None  # once loaded
        self.monitors: dict[str, Monitors] = {}  # each adapter's drift monitor and accuracy estimate, by name
        self.server = None  # uvicorn.Server when run by ibedl.serve.__main__, to notice SIGTERM
        self.switcher = None  # ibedl.serve.backend_switch.BackendSwitcher while auto measures in the background
        self._watcher: asyncio.Task | None = None
        self._reloader: asyncio.Task | None = None
        self._manifests: dict = {}  # served artifact directory -> its manifest.json's mtime when last looked at
        self._poke: asyncio.Event | None = None  # set by SIGHUP: look at the manifests now
        self._hangup = None  # the signal whose handler this state installed (SIGHUP), to remove at shutdown
        self._swapping = asyncio.Lock()  # one runtime replacement at a time: a backend switch or a reload
        self._checker: ThreadPoolExecutor | None = None
        self._store_thread: ThreadPoolExecutor | None = None

    async def off_loop(self, fn: Callable, *args):
        """``fn(*args)`` on the request-checking thread; its exception is raised here. Tokenizing a prompt takes
        milliseconds of CPU, too long for the event loop; one thread, so the adapters' counting tokenizers are never
        used by two threads at once."""
        if self._checker is None:
            self._checker = ThreadPoolExecutor(1, thread_name_prefix="ibedl-check")
        return await asyncio.get_running_loop().run_in_executor(self._checker, fn, *args)

    def _store_calls(self) -> ThreadPoolExecutor:
        """The feedback store's own thread, never the event loop nor the default pool that /metrics uses: a store
        that waits (another replica's lock, a slow or unreachable server) holds only this thread."""
        if self._store_thread is None:
            self._store_thread = ThreadPoolExecutor(1, thread_name_prefix="ibedl-store")
        return self._store_thread

    async def on_store(self, fn: Callable, *args, timeout: float | None = None):
        """``fn(*args)`` on the feedback store's thread, waited for at most ``timeout`` seconds (default STORE_WAITS x
        IBEDL_FEEDBACK_TIMEOUT_S), then StoreUnavailable; the call itself goes on to its end on its thread (a label
        it records counts: sent again, it is a duplicate)."""
        call = asyncio.get_running_loop().run_in_executor(self._store_calls(), fn, *args)
        wait = STORE_WAITS * self.settings.feedback_timeout_s if timeout is None else timeout
        try:
            return await asyncio.wait_for(call, wait)
        except asyncio.TimeoutError:
            raise errors.StoreUnavailable(f"the feedback store did not answer within {wait:g} s; retry shortly",
                                          retry_after=max(1, math.ceil(self.settings.feedback_timeout_s))) from None

    @property
    def runtimes(self) -> dict[str, AdapterRuntime]:
        """The served adapters by name, the default first (none until loaded)."""
        return {} if self.engine is None else self.engine.runtimes

    @property
    def batcher(self):
        """The engine's scheduler (None until loaded)."""
        return None if self.engine is None else self.engine.batcher

    @property
    def default(self) -> AdapterRuntime | None:
        """The adapter a request that names none gets (the first loaded); None until loaded."""
        return None if self.engine is None else self.engine.default

    def runtime(self, name: str | None, field: str = "adapter") -> AdapterRuntime:
        """The served adapter called ``name`` (None: the default); UnknownAdapter naming the served ones otherwise."""
        assert self.engine is not None
        return self.engine.runtime(name, field)

    # -- lifecycle ------------------------------------------------------------------------------

    async def load(self) -> None:
        # what the manifests are before loading: a recalibration written while the model loads is seen at once
        self._manifests = {d: _mtime(d) for d in self.settings.served_artifacts()}
        self._poke = asyncio.Event()
        hangup = getattr(signal, "SIGHUP", None)
        if hangup is not None:  # SIGHUP looks at the manifests (its default action would end the process)
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # only the main thread's loop
                asyncio.get_running_loop().add_signal_handler(hangup, self._poke.set)
                self._hangup = hangup
        try:
            loaded = await asyncio.to_thread(self.loader, self.settings)
            predictors = loaded if isinstance(loaded, list) else [loaded]
            to_measure = self._to_measure(predictors)
            runtimes = await asyncio.to_thread(make_runtimes, predictors, self.engine_settings, bool(to_measure))
            monitors = {name: await asyncio.to_thread(self._monitors, rt) for name, rt in runtimes.items()}
            # one trunk: one estimate of seconds per token for every adapter (the heads' cost is negligible)
            service_time = await asyncio.to_thread(warm_up, [rt.predictor for rt in runtimes.values()])
            await self._bind_feedback(runtimes)
        except Exception as e:  # a broken artifact must not kill the process: readiness reports it
            # The log has the exception's text and traceback (paths, hashes, settings); clients get its type alone.
            log.exception("loading the adapter failed")
            self.status, self.reason = "failed", f"the adapter failed to load ({type(e).__name__}); the service log " \
                "has the reason (the line 'loading the adapter failed')"
            if isinstance(e, UncalibratedBackend):  # names backends and calibrations only: what the operator must do
                self.reason = f"the adapter failed to load: {e}"
            return
        self.monitors = monitors
        self.engine = Engine(runtimes, self.engine_settings, self.feedback, service_time, self.admission,
                             on_batch=self._on_batch, on_depth=self.metrics.queue_depth.set)
        self.engine.answer_hooks.append(self._observe)
        await self.engine.start()
        self.metrics.seconds_per_token.set(service_time.per_token_s)
        self._watcher = asyncio.get_running_loop().create_task(self._watch_shutdown(), name="shutdown-watcher")
        for name, rt in runtimes.items():
            self._publish(rt)
            log.info("serving adapter %s (%s) on %s", name, rt.predictor.manifest.method,
                     rt.predictor.manifest.base_model_ref().name)
        self.status, self.reason = "ready", None
        self.metrics.ready.set(1)
        self._reloader = asyncio.get_running_loop().create_task(self._watch_manifests(), name="manifest-watcher")
        if to_measure:
            self._start_switcher(to_measure)

    def _monitors(self, rt: AdapterRuntime) -> Monitors:
        """A fresh drift monitor (against the calibration's reference) and accuracy estimate for an adapter."""
        target = rt.thresholds.how.get("target_accuracy")
        return Monitors(DriftMonitor(rt.reference(), rt.drift_statistic, self.settings.drift_window,
                                     self.settings.drift_alarm_rate, self.settings.drift_bootstrap),
                        AccuracyEstimate(self.settings.drift_window, float(target) if target else None))

    def _publish(self, rt: AdapterRuntime) -> None:
        """The gauges that say which version of an adapter is served and how its drift and estimate stand."""
        manifest, base = rt.predictor.manifest, rt.predictor.manifest.base_model_ref()
        self.metrics.model_info.labels(adapter=rt.name).info(
            {"version": str(manifest.version), "method": manifest.method, "base_model": base.name,
             "base_sha256": base.sha256[:12]})
        self.metrics.set_drift(rt.name, self.monitors[rt.name].drift.status())
        self.metrics.set_accuracy(rt.name, self.monitors[rt.name].accuracy.status())

    # -- new versions of the served weights (recalibrations) ------------------------------------

    async def reload_calibrations(self) -> list[str]:
        """Serve the version each served adapter's manifest.json now holds, when it is another one of the same
        weights (a recalibration: ``python -m ibedl.training.calibrate`` in place), from the next request on: a new
        runtime beside the old one (ibedl.engine.runtime.recalibrated; a pass already queued is answered under the old
        calibration), a fresh drift monitor on its reference, and the labels of the new version counted apart (its
        promises are its own; the old version's realised guarantees stay on GET /v1/guarantees as retired). A
        manifest that changes the weights, or cannot be read, is logged and left for a restart. Returns the adapters
        now on a new version."""
        from ibedl.core.artifact import ArtifactError, read_manifest

        done = []
        for directory in self.settings.served_artifacts():
            try:
                manifest = await asyncio.to_thread(read_manifest, directory)
            except (ArtifactError, OSError, ValueError) as e:
                log.warning("reload: the manifest of %s cannot be read (%s); still serving what was loaded", directory,
                            e)
                continue
            async with self._swapping:  # a backend switch does not interleave: neither undoes the other
                rt = self.runtimes.get(manifest.name)
                if rt is None or str(manifest.version) == rt.ref["version"]:
                    continue
                try:
                    new = recalibrated(rt, manifest, self.engine_settings)
                    monitors = await asyncio.to_thread(self._monitors, new)
                except (ValueError, UncalibratedBackend) as e:
                    log.warning("reload: adapter %s version %s is not served: %s", manifest.name, manifest.version, e)
                    continue
                self.runtimes[new.name] = new
                self.monitors[new.name] = monitors
            self._publish(new)
            if self.feedback.enabled:
                with contextlib.suppress(errors.StoreUnavailable):  # the next refresh reads the store
                    await self.on_store(self.feedback.bind, self.runtimes)
            log.info("adapter %s: serving version %s (recalibrated; was %s, calibration %s)", new.name,
                     new.ref["version"], rt.ref["version"], new.calibration.key)
            done.append(new.name)
        return done

    async def _watch_manifests(self) -> None:
        """Look at the served manifests every IBEDL_RELOAD_INTERVAL_S (and at once on SIGHUP): a changed one is
        reloaded (:meth:`reload_calibrations`)."""
        poke = self._poke
        interval = self.settings.reload_interval_s or None
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(poke.wait(), interval)
            forced = poke.is_set()
            poke.clear()
            seen = {d: _mtime(d) for d in self.settings.served_artifacts()}
            if forced or seen != self._manifests:
                self._manifests = seen
                try:
                    await self.reload_calibrations()
                except Exception:  # a reload must never stop the watcher
                    log.exception("reload: failed; still serving what was loaded")

    # -- backends (IBEDL_BACKEND=auto) --------------------------------------------------------------

    def _to_measure(self, predictors: list[Predictor]) -> list[str]:
        """The backends ``auto`` still has to build and time for the one served adapter, in the background: those
        never measured here, or every candidate once the measurement is older than IBEDL_BACKEND_MAX_AGE_S; none
        with IBEDL_BACKEND_SWITCHING off or a named backend."""
        from ibedl.core.auto_backend import age_s

        choice = predictors[0].backend_choice if len(predictors) == 1 else None
        if self.settings.backend != "auto" or not self.settings.backend_switching or choice is None:
            return []
        if choice.pending:
            return list(choice.pending)
        age = age_s(choice)
        if choice.cached and age is not None and age > self.settings.backend_max_age_s:
            log.info("auto: the measurement of %s is %.0f s old (IBEDL_BACKEND_MAX_AGE_S %.0f): measuring again in "
                     "the background", choice.path, age, self.settings.backend_max_age_s)
            return [n for n in choice.seconds if n != choice.backend]
        return []

    def _start_switcher(self, names: list[str]) -> None:
        from ibedl.serve.backend_switch import BackendSwitcher

        self.switcher = BackendSwitcher(self, self.default.name, names)
        self.switcher.start()
        log.info("auto: serving %s; building and timing %s in the background", self.default.ref["backend"],
                 ", ".join(names))

    async def switch_backend(self, adapter: str, backend: str, trunk, reason: str, choice) -> None:
        """Serve ``adapter`` on ``backend`` (its ``trunk``) from now on: one assignment of a new runtime with the
        calibration made on it (ibedl.engine.runtime.switched), on the event loop. Requests that took the old runtime
        are answered on it, under its calibration; the next ones on the new one."""
        async with self._swapping:
            old = self.runtimes[adapter]
            new = switched(old, backend, trunk, reason, choice, self.settings.served_artifacts()[0],
                           self.engine.settings)
            self.runtimes[adapter] = new
        self.metrics.backend_switches.labels(adapter=adapter, **{"from": old.ref["backend"], "to": backend}).inc()
        log.info("auto: adapter %s switched from %s (calibration %s) to %s (calibration %s): %s", adapter,
                 old.ref["backend"], old.ref["calibration"], backend, new.ref["calibration"], reason)

    async def settle_backend(self, adapter: str, choice) -> None:
        """The background measurement is done: record it on the serving predictor (``GET /v1/models``) and drop the
        torch model where a backend's trunk answers without it (between passes)."""
        predictor = self.runtimes[adapter].predictor
        predictor.record_choice(choice)
        if predictor.trunk is not None:
            await self.batcher.between_passes(predictor.release_model)

    def backend_status(self) -> dict | None:
        """What the background measurement is doing and has done (``GET /v1/models``: ``backend.background``)."""
        if self.switcher is None:
            return None
        return copy.deepcopy(self.switcher.status)

    async def _bind_feedback(self, runtimes: dict[str, AdapterRuntime]) -> None:
        """Open the feedback store and catch up with it (its checkpoint, then the labels after it). A store that does
        not answer (yet: a database still starting) is waited for, the reason on the readiness probe, as long as
        the orchestrator lets the replica start."""
        while True:
            try:
                await asyncio.get_running_loop().run_in_executor(self._store_calls(), self.feedback.bind, runtimes)
                return
            except errors.StoreUnavailable as e:
                self.reason = f"waiting for the feedback store: {e.message}"
                log.warning("%s", self.reason)
                await asyncio.sleep(STORE_RETRY_S)

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
        for task in (self._watcher, self._reloader):
            if task is not None:
                task.cancel()
        if self._hangup is not None:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                asyncio.get_running_loop().remove_signal_handler(self._hangup)
            self._hangup = None
        if self.batcher is not None:
            await self.batcher.stop()
        if self._checker is not None:
            self._checker.shutdown(wait=False, cancel_futures=True)
            self._checker = None
        if self._store_thread is not None:
            if self.feedback.store is not None:  # after the calls already queued
                self._store_thread.submit(self.feedback.store.close)
            self._store_thread.shutdown(wait=False)
            self._store_thread = None

    def health(self) -> tuple[int, Health]:
        if self.status == "ready" and self.server is not None and getattr(self.server, "should_exit", False):
            self.begin_drain()
        if self.status == "ready":
            return 200, Health(status="ready")
        return 503, Health(status=self.status, reason=self.reason)

    def accepting(self) -> bool:
        """Whether a request arriving now is admitted: the model is loaded and no shutdown has begun."""
        return self.health()[0] == 200

    def busy_for(self, timeout_header: str | None, arrived: float) -> float | None:
        """Seconds to wait before retrying when not even the smallest request could be answered before this one's
        deadline (:meth:`ibedl.engine.admission.Admission.busy_for`); None when one could, or before the model is
        ready (the route answers then)."""
        if self.batcher is None or self.status != "ready":
            return None
        return self.admission.busy_for(arrived, timeout_header, self.batcher.expected_wait([0]))

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
            raise errors.NotReady(f"the service is {health.status}: {health.reason}", retry_after=5)

    # -- batching -------------------------------------------------------------------------------

    def _on_batch(self, size: int, seconds: float) -> None:
        self.metrics.batch_size.observe(size)
        self.metrics.forward_seconds.observe(seconds)
        if self.batcher is not None:
            self.metrics.seconds_per_token.set(self.batcher.service_time.per_token_s)
            self.metrics.admission_overrun.set(self.batcher.overrun)

    def deadline(self, request: Request) -> float:
        """The admission clock's time by which ``request`` must be answered: from its arrival, the server's request
        timeout or the shorter ``X-Request-Timeout`` (seconds) the client sent (422 when that is not one)."""
        arrived = request.scope.get("state", {}).get("arrived")
        try:
            return self.admission.deadline(self.admission.clock() if arrived is None else arrived,
                                           request.headers.get(TIMEOUT_HEADER))
        except InvalidTimeout as e:
            raise errors.InvalidRequest(str(e), TIMEOUT_HEADER) from None

    async def answer(self, checked: list[Checked], request: Request, ids: list[str]) -> list[PredictResponse]:
        """The answers to one request's checked questions (one adapter), scheduled by the engine
        (:meth:`ibedl.engine.engine.Engine.submit`): due by the request's deadline, its queued questions dropped
        when the client goes away. A refusal is counted under its reason (``ibedl_rejected_total``) and raised as it
        is; non-finite model numbers are counted and logged."""
        assert self.engine is not None
        deadline = self.deadline(request)
        scope = request.scope.get("state", {})
        try:
            own = deadline < scope.get("arrived", 0.0) + self.settings.request_timeout_s  # the client's is shorter
            return await self.engine.submit(checked, deadline, ids, TIMEOUT_HEADER if own else None,
                                            scope.get("admitted", False), lambda: _disconnected(request))
        except errors.ModelError as e:
            self.metrics.nonfinite.inc(e.nonfinite)
            log.error("the model gave non-finite numbers for %d of %d questions (request %s); not answered",
                      e.nonfinite, len(checked), scope.get("request_id"))
            raise
        except errors.EngineError as e:
            if e.reason is not None:
                self.metrics.rejected.labels(reason=e.reason).inc(len(checked))
            raise

    def _observe(self, runtime: AdapterRuntime, q, pred, answer: PredictResponse) -> None:
        """An answer the engine gave (its answer hook): recorded in the adapter's metrics, drift window and
        accuracy estimate."""
        m, name, monitors = self.metrics, runtime.name, self.monitors[runtime.name]
        m.answers.labels(adapter=name).inc()
        m.confidence.labels(adapter=name).observe(pred.confidence)
        m.predictions.labels(adapter=name, letter=pred.letter).inc()
        if pred.uncertainty is not None:
            m.uncertainty.labels(adapter=name).observe(pred.uncertainty)
        if answer.guarantees is not None and answer.guarantees.holds is False:
            m.uncalibrated_options.labels(adapter=name, options=str(q.num_options),
                                          reason=answer.guarantees.reason).inc()
        if answer.abstain_reason:
            m.abstentions.labels(adapter=name, reason=answer.abstain_reason).inc()
        else:  # an answered question feeds the accuracy estimate; every one feeds drift
            monitors.accuracy.add([pred.confidence])
        drift = monitors.drift
        drift.add([pred.uncertainty if drift.statistic == "uncertainty_mass" else pred.confidence])

    async def record_feedback(self, items: list[FeedbackRequest], prefix: str, credential: str) -> FeedbackResponse:
        """Record labels sent with ``credential`` (:meth:`ibedl.engine.engine.Engine.record_feedback`, on the store's
        thread; all or none, within its quota: IBEDL_MAX_LABELS per IBEDL_LABEL_WINDOW_S), counted by adapter and
        outcome; a refused label that contradicts its receipt's first label is counted as a conflict."""
        quota = LabelQuota(credential, self.settings.max_labels, self.settings.label_window_s)
        try:
            response = await self.on_store(self.engine.record_feedback, items, prefix, quota)
        except errors.LabelConflict as e:
            for adapter in e.adapters:
                self.metrics.feedback_conflicts.labels(adapter=adapter).inc()
            log.warning("refused %d label(s) contradicting the first label of their receipt: %s", len(e.adapters),
                        e.message)
            raise
        for r in response.results:
            self.metrics.feedback_labels.labels(adapter=r.adapter, status=r.status).inc()
        return response

    async def guarantees(self, adapter: str | None = None, timeout: float | None = None) -> GuaranteesResponse:
        """The realised guarantees from the feedback store (:meth:`ibedl.engine.engine.Engine.guarantees`), also set
        on their gauges (the served versions' only); 404 when feedback is off. Waits for the store as
        :meth:`on_store` does (``timeout``); the gauges are set when the store answers, even after the wait gave up
        (StoreUnavailable)."""
        def read() -> GuaranteesResponse:
            found = self.engine.guarantees(adapter)
            self.metrics.set_guarantees([g.model_dump() for g in found.guarantees])
            return found

        return await self.on_store(read, timeout=timeout)

    def drift_status(self, runtime: AdapterRuntime) -> DriftStatus:
        """The adapter's drift monitor's and accuracy estimate's status, also set on their gauges."""
        monitors = self.monitors[runtime.name]
        status, accuracy = monitors.drift.status(), monitors.accuracy.status()
        self.metrics.set_drift(runtime.name, status)
        self.metrics.set_accuracy(runtime.name, accuracy)
        return DriftStatus(**status, **accuracy)


@dataclass
class Monitors:
    """What the service watches per adapter: its drift monitor and the running estimate of its accuracy."""

    drift: DriftMonitor
    accuracy: AccuracyEstimate


def _mtime(directory) -> float | None:
    """When an artifact's manifest.json last changed (None: unreadable)."""
    try:
        return (Path(directory) / "manifest.json").stat().st_mtime_ns
    except OSError:
        return None


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def get_state(request: Request) -> ServiceState:
    return request.app.state.service


State = Annotated[ServiceState, Depends(get_state)]
