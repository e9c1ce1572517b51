"""The engine: the served adapters, the scheduler that answers them (admission, fair turns, batching, capacity,
deadlines), their lifecycle (loading, ready, draining, stopped), the runtimes that change while it runs (reloads,
backend switches: ``ibedl.engine.versions``) and labelled feedback. Every door calls one :class:`Engine` and only
translates: the Python API (``ibedl.api``), HTTP v1 and the Open Inference Protocol over REST and gRPC
(``ibedl.serve``).

    engine = Engine.load(EngineSettings(artifacts=[Path("artifacts/default")]))      # loaded and ready
    engine.predict([{"question": "...", "options": ["...", "..."]}])                # from any thread: scheduled

    engine = Engine(settings); await engine.open()        # a service: ready when open() returns (health() says so)
    context = engine.arrive(request_id, timeout)          # on arrival: admitted or not, from then
    await engine.ask(items, context)                      # on the engine's event loop

Observers (``ibedl.engine.observer``) see what happens (the service's metrics and drift monitors); refusals are
the engine's errors (``ibedl.engine.errors``), each with the ``reason`` it is counted under.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import operator
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pydantic import ValidationError

from ibedl.core.predictor import Prediction
from ibedl.core.prompt import MCQuestion
from ibedl.engine.admission import Admission, InvalidTimeout
from ibedl.engine.batcher import SIMILAR, MicroBatcher
from ibedl.engine.capacity import ServiceTime, warm_up
from ibedl.engine.context import TIMEOUT_HEADER, RequestContext
from ibedl.engine.errors import (
    Cancelled,
    EngineError,
    InvalidRequest,
    LabelConflict,
    ModelError,
    NeedsTooLong,
    NotReady,
    Overloaded,
    StoreUnavailable,
    Timeout,
    TooLarge,
    described,
    too_many_items,
)
from ibedl.engine.feedback import Feedback, LabelQuota, served_versions
from ibedl.engine.observer import Observer
from ibedl.engine.requests import to_question, tokenized, within_tokens
from ibedl.engine.responses import build_answer, model_card
from ibedl.engine.runtime import (
    AdapterRuntime,
    UncalibratedBackend,
    find_adapter,
    finite_prediction,
    load_predictors,
    make_runtimes,
)
from ibedl.engine.schemas import FeedbackRequest, FeedbackResponse, GuaranteesResponse, PredictRequest, PredictResponse
from ibedl.engine.settings import EngineSettings
from ibedl.engine.store_calls import StoreCalls
from ibedl.engine.versions import Versions

log = logging.getLogger("ibedl.engine")
STORE_RETRY_S = 2.0  # while loading, a store that does not answer (yet) is tried again this often
# A loader gives the predictors of the served adapters (the default first), or the one predictor of one adapter;
# tests give one that slows or breaks the model.
Loader = Callable[[EngineSettings], object]


@dataclass
class Checked:
    """A question the engine accepts: its adapter, request body, parsed question and prompt tokens."""

    runtime: AdapterRuntime
    request: PredictRequest
    question: MCQuestion
    tokens: int


class Engine:
    """The served adapters on one base model, their scheduler, lifecycle and feedback.

    Args:
        settings: the engine's settings (adapters, limits, scheduler, feedback, drain, reload).
        loader: gives the predictors of ``settings``' adapters (default ``ibedl.engine.runtime.load_predictors``).
        feedback: receipts out, labels in (default: from ``settings``).
        admission: the admission policy (default: from ``settings``, on ``time.monotonic``; tests give a clock).
        observers: what watches the engine (``ibedl.engine.observer.Observer``).
    """

    def __init__(self, settings: EngineSettings, loader: Loader | None = None, feedback: Feedback | None = None,
                 admission: Admission | None = None, observers: list[Observer] | tuple = ()) -> None:
        self.settings = settings
        self.loader = loader or load_predictors
        self.feedback = Feedback(settings) if feedback is None else feedback
        self.admission = admission or Admission(settings.request_timeout_s, settings.admission_margin)
        self.observers = list(observers)
        self.runtimes: dict[str, AdapterRuntime] = {}
        self.batcher: MicroBatcher | None = None
        self.status, self.reason = "loading", "the model is loading"
        self.versions = Versions(self)
        self.store = StoreCalls(settings.feedback_timeout_s)
        self._checker: ThreadPoolExecutor | None = None
        # Every torch call of the engine (loading, warm-up, passes, background timings, the runtimes of a reload or a
        # backend switch) runs on this one thread: torch's OpenMP (libgomp) keeps a team of workers per thread that
        # has run a parallel region, and once the teams hold more threads than the machine has cores its workers spin
        # only briefly between regions, so each of a forward's many regions puts them to sleep and wakes them.
        # Loaded on one thread and served on another, the service's model call took 1.55x the bare predictor's on 2
        # AVX2 cores, 4,394 voluntary context switches a question against 32 (benchmarks/results/service_latency*).
        self._model = ThreadPoolExecutor(1, thread_name_prefix="ibedl-model")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._loaded = False  # made by load() for a Python caller: close() releases it; a door stops its own

    # -- loading --------------------------------------------------------------------------------

    def _load(self, measure: bool) -> tuple[dict[str, AdapterRuntime], ServiceTime, list[str]]:
        """The adapters' runtimes, the first estimate of seconds per token (one trunk: one estimate), and the backends
        ``auto`` still has to measure in the background (``measure``: a service that may)."""
        loaded = self.loader(self.settings)
        predictors = loaded if isinstance(loaded, list) else [loaded]
        to_measure = self.versions.to_measure(predictors) if measure else []
        runtimes = make_runtimes(predictors, self.settings, bool(to_measure))
        return runtimes, warm_up([rt.predictor for rt in runtimes.values()]), to_measure

    def _serve(self, runtimes: dict[str, AdapterRuntime], service_time: ServiceTime) -> None:
        self.runtimes = runtimes
        # the default runtime as it is at each pass, not its predict at start: a bound method would pin the start's
        # runtime, and with it the torch model, after a backend switch (requests pass their runtime's own predict)
        self.batcher = MicroBatcher(
            lambda questions: self.default.predict(questions), self.settings.max_batch_size,
            self.settings.max_wait_ms, self.settings.queue_size,
            on_batch=self._on_batch, on_depth=lambda n: self.notify("depth", n),
            max_batch_tokens=self.settings.max_batch_tokens, service_time=service_time, admission=self.admission,
            executor=self._model, similar=math.inf if self.settings.pad_freely else SIMILAR)

    @classmethod
    def load(cls, settings: EngineSettings, loader: Loader | None = None) -> Engine:
        """The adapters of ``settings`` loaded, timed once and with their feedback store opened, ready: what the
        Python API serves (its scheduler starts on a thread of its own at the first question)."""
        engine = cls(settings, loader)
        try:
            runtimes, service_time, _ = engine._model.submit(engine._load, False).result()
            engine.feedback.bind(runtimes)  # a Python caller attaches observers after loading: none to tell here
        except BaseException:
            engine._model.shutdown(wait=False)
            engine.store.close(engine.feedback.store)  # opened by bind before a later step failed
            raise
        engine._serve(runtimes, service_time)
        engine._loaded = True
        engine._ready()
        return engine

    async def open(self) -> None:
        """Load on the running event loop (the model in a thread, so the loop answers health checks meanwhile), wait
        for the feedback store, start the scheduler and become ready; ``IBEDL_BACKEND=auto`` goes on measuring in the
        background. A load that fails leaves the engine ``failed`` with the reason (the exception is logged)."""
        self.versions.remember_manifests()
        try:
            runtimes, service_time, to_measure = await asyncio.get_running_loop().run_in_executor(
                self._model, self._load, True)
            await self._bind_feedback(runtimes)
        except Exception as e:  # a broken artifact must not kill the process: readiness reports it
            # The log has the exception's text and traceback (paths, hashes, settings); clients get its type alone.
            log.exception("loading the adapter failed")
            self.status, self.reason = "failed", f"the adapter failed to load ({type(e).__name__}); the service " \
                "log has the reason (the line 'loading the adapter failed')"
            if isinstance(e, UncalibratedBackend):  # names backends and calibrations only: what the operator must do
                self.reason = f"the adapter failed to load: {e}"
            return
        for runtime in runtimes.values():
            await asyncio.to_thread(self.notify, "serving", runtime)
        await self._warm_checks(runtimes)  # before the last look at the status: nothing awaits between it and ready
        if self.status != "loading":  # drained (SIGTERM) or stopped while loading: it never becomes ready
            log.info("loaded after the shutdown began; not serving")
            return
        self._serve(runtimes, service_time)
        await self.start()
        self.notify("estimated", service_time.per_token_s)
        for name, rt in runtimes.items():
            log.info("serving adapter %s (%s) on %s", name, rt.predictor.manifest.method,
                     rt.predictor.manifest.base_model_ref().name)
        self._ready()
        self.versions.start(to_measure)

    async def _bind_feedback(self, runtimes: dict[str, AdapterRuntime]) -> None:
        """Open the feedback store and catch up with it (its checkpoint, then the labels after it). A store that does
        not answer (yet: a database still starting) is waited for, the reason on the readiness probe."""
        while True:
            try:
                await self.store.run(self.feedback.bind, runtimes, timeout=float("inf"))
                return
            except StoreUnavailable as e:
                if self.status != "loading":  # drained or stopped meanwhile (its store closed): nothing to wait for
                    return
                self.reason = f"waiting for the feedback store: {e.message}"
                log.warning("%s", self.reason)
                await asyncio.sleep(STORE_RETRY_S)

    def _ready(self) -> None:
        self.status, self.reason = "ready", None
        self.notify("readiness", True)

    def notify(self, event: str, *args) -> None:
        """Tell every observer of ``event`` (an :class:`~ibedl.engine.observer.Observer` method's name)."""
        for observer in self.observers:
            getattr(observer, event)(*args)

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the scheduler on the running event loop (the service's; the Python API's own thread)."""
        self._loop = asyncio.get_running_loop()
        self.batcher.start()

    def health(self) -> tuple[str, str | None]:
        """(status, reason): ``loading``, ``ready``, ``draining``, ``failed`` or ``stopped``; the reason when not
        ready. Changes nothing."""
        return self.status, self.reason

    @property
    def ready(self) -> bool:
        return self.status == "ready"

    def fail(self, reason: str) -> None:
        """Mark the engine failed (readiness says ``reason``) before it loaded: a door that cannot open."""
        self.status, self.reason = "failed", reason

    @property
    def feedback_enabled(self) -> bool:
        """Whether answers carry receipts and labels are recorded (IBEDL_FEEDBACK_KEY)."""
        return self.feedback.enabled

    def poke(self) -> None:
        """Look at the served manifests now (a recalibration written in place is served from the next request)."""
        self.versions.poke()

    def drain(self, grace_s: float | None = None) -> None:
        """Stop admitting (a request that arrives from now on is refused, NotReady); answer what was admitted and
        can finish within ``grace_s`` seconds (default IBEDL_SHUTDOWN_GRACE_S). On the engine's event loop."""
        grace = self.settings.shutdown_grace_s if grace_s is None else grace_s
        if self.status == "draining":
            return
        if self.status == "ready":
            log.info("shutting down: draining for up to %.0f s", grace)
        self.status, self.reason = "draining", "the service is shutting down"
        self.notify("readiness", False)
        if self.batcher is not None:
            self.batcher.begin_drain(grace)

    async def stop(self) -> None:
        """Drain, then stop the scheduler, the watchers and the feedback store's thread (on the engine's loop)."""
        self.drain()
        self.versions.stop()
        if self.batcher is not None:
            await self.batcher.stop()
        # after the pass in flight; a load still running (stopped while loading) is not waited for
        await asyncio.to_thread(self._model.shutdown, wait=self.batcher is not None, cancel_futures=True)
        if self._checker is not None:
            self._checker.shutdown(wait=False, cancel_futures=True)
            self._checker = None
        self.store.close(self.feedback.store)
        self.status = "stopped"

    # -- adapters -------------------------------------------------------------------------------

    @property
    def default(self) -> AdapterRuntime:
        """The adapter a question that names none gets (the first loaded)."""
        return next(iter(self.runtimes.values()))

    def runtime(self, name: str | None, field: str = "adapter") -> AdapterRuntime:
        """The adapter called ``name`` (None: the default); UnknownAdapter naming the served ones otherwise."""
        return find_adapter(self.runtimes, name, field)

    def cards(self) -> list[dict]:
        """What ``GET /v1/models`` says of each adapter; the default's backend says what the background
        measurement does (``backend.background``)."""
        cards = [model_card(rt, self.settings, self.feedback.suspension(rt)) for rt in self.runtimes.values()]
        if cards:
            cards[0]["backend"]["background"] = self.versions.background()
        return cards

    # -- admission ------------------------------------------------------------------------------

    def arrive(self, request_id: str | None = None, timeout: str | float | None = None,
               gone: Callable[[], Awaitable] | None = None) -> RequestContext:
        """A request arriving now: admitted when the engine is ready. Deadlines count from here."""
        extra = {} if request_id is None else {"request_id": request_id}
        return RequestContext(self.admission.clock(), self.ready, timeout, gone=gone, **extra)

    def deadline(self, context: RequestContext) -> float:
        """The admission clock's time by which the request must be answered: from its arrival, the request timeout
        or the caller's shorter one: HTTP's header as sent (InvalidRequest when it is not a positive number of
        seconds) or seconds (gRPC's time remaining: Timeout when none is left); ``math.inf`` for a context whose
        timeout is (the Python API's without one)."""
        timeout = context.timeout
        if timeout is None or isinstance(timeout, str):  # none, or HTTP's header as sent
            try:
                return self.admission.deadline(context.arrived, timeout)
            except InvalidTimeout as e:
                raise InvalidRequest(str(e), TIMEOUT_HEADER) from None
        if timeout == math.inf:  # the Python API without a timeout: no deadline
            return math.inf
        if not timeout > 0:  # a gRPC call whose deadline passed before it arrived
            raise Timeout("the call's deadline had passed when it arrived")
        return context.arrived + min(self.settings.request_timeout_s, timeout)

    def require(self, context: RequestContext) -> None:
        """NotReady (with Retry-After) unless the engine can answer this request: it is ready, or the request was
        admitted before a drain began and the scheduler still runs."""
        if self.ready:
            return
        if not (context.admitted and self.status == "draining" and self.batcher is not None and self.batcher.running):
            raise NotReady(f"the service is {self.status}: {self.reason}", retry_after=5)

    def refuse_early(self, context: RequestContext) -> None:
        """The cheap check before a request's body is read or tokenized: NotReady as :meth:`require`, or Overloaded
        (with Retry-After) when not even the smallest request could be answered before this one's deadline; Timeout
        instead when the deadline is the caller's own, shorter than the service's, and even an idle service could
        not meet it (a gateway must not retry that elsewhere as overload)."""
        self.require(context)
        deadline = self.deadline(context)  # a timeout that is not one: refused before anything else
        if not self.ready or deadline == math.inf:
            return
        wait = self.admission.busy_until(deadline, self.batcher.expected_wait([0]))
        if wait is None:
            return
        own = deadline < context.arrived + self.settings.request_timeout_s
        if own and self.admission.busy_until(deadline, self.batcher.service_time.seconds(0)) is not None:
            self.notify("refused", Timeout.reason, 1)
            raise Timeout(f"the caller's own deadline ({TIMEOUT_HEADER} over HTTP) is shorter than even the "
                          "smallest request takes alone")
        self.notify("refused", Overloaded.reason, 1)
        raise Overloaded("the service is busy: no request could be answered before its deadline now", wait)

    # -- checking -------------------------------------------------------------------------------

    def check(self, question: dict | PredictRequest | MCQuestion, prefix: str = "",
              adapter: str | None = None) -> Checked:
        """A question checked against the engine's limits (an ``EngineError`` if it breaks one); ``adapter``: the
        adapter of a question that names none. Counts its prompt's tokens (milliseconds of CPU: off the loop)."""
        req = as_request(question, prefix)
        runtime = self.runtime(req.adapter or adapter, prefix + "adapter")
        (q,) = tokenized(runtime, [to_question(runtime, self.settings, req, prefix)])
        return Checked(runtime, req, q, within_tokens(self.settings, q, prefix))

    def check_request(self, items: list[PredictRequest], field: str = "items") -> list[Checked]:
        """The items of one request, checked: at most ``max_batch_items``, one adapter, at most
        ``max_request_tokens`` prompt tokens in all. ``field`` names the items in refusals."""
        limit = self.settings.max_batch_items
        if len(items) > limit:
            raise TooLarge(too_many_items(len(items), limit), field)
        names = {self.runtime(item.adapter, f"{field}.{i}.adapter").name for i, item in enumerate(items)}
        if len(names) > 1:
            raise InvalidRequest(f"the items of one batch must use one adapter, got {sorted(names)}; send one batch "
                                 "per adapter", field)
        if not items:
            return []
        # one runtime for all (a backend switch between two items' lookups would split the request); every item's
        # fields, then their prompts tokenised in one call (about half the time of a call each at 64 items:
        # benchmarks/results/pass_overhead_cpu.json), then each prompt's token limit
        runtime = self.runtime(items[0].adapter, f"{field}.0.adapter")
        prefixes = [f"{field}.{i}." for i in range(len(items))]
        questions = [to_question(runtime, self.settings, item, prefix) for item, prefix in zip(items, prefixes,
                                                                                               strict=True)]
        checked = [Checked(runtime, item, q, within_tokens(self.settings, q, prefix))
                   for item, q, prefix in zip(items, tokenized(runtime, questions), prefixes, strict=True)]
        budget = self.settings.max_request_tokens
        total = sum(c.tokens for c in checked)
        if total > budget:
            raise TooLarge(f"the items' prompts are {total} tokens in all; the limit per request is {budget}: "
                           "send them in smaller batches", field)
        return checked

    def _checks(self) -> ThreadPoolExecutor:
        """The request-checking threads (``IBEDL_CHECK_THREADS``), started at the first use."""
        if self._checker is None:
            self._checker = ThreadPoolExecutor(self.settings.check_threads, thread_name_prefix="ibedl-check")
        return self._checker

    async def off_loop(self, fn: Callable, *args):
        """``fn(*args)`` on one of the request-checking threads (tokenizing takes milliseconds of CPU, too long for
        the event loop); its exception is raised here."""
        return await asyncio.get_running_loop().run_in_executor(self._checks(), fn, *args)

    async def _warm_checks(self, runtimes: dict[str, AdapterRuntime]) -> None:
        """Every check thread started and holding its copy of each runtime's tokenizer before the first request: a
        copy takes about 0.1 s, and made on demand, under the copies' lock, the first requests would wait for them
        one after another. One task a thread: each waits until every thread runs one (else the pool may reuse an
        idle thread). A runtime of a later reload or backend switch copies on demand, and so does every thread when
        this fails (logged: the service still becomes ready). Nothing is started once a shutdown began."""
        if self.status != "loading":
            return
        n = self.settings.check_threads
        together = threading.Barrier(n)

        def warm() -> None:
            with contextlib.suppress(threading.BrokenBarrierError):  # never: then the copies are made on demand
                together.wait(60)
            for runtime in runtimes.values():
                runtime.count_tokenizers.get()

        try:
            await asyncio.gather(*(asyncio.wrap_future(self._checks().submit(warm)) for _ in range(n)))
        except Exception:  # noqa: BLE001  (a copy made on demand instead is slower, not wrong)
            log.warning("the check threads' tokenizer copies were not made at start; they are made on demand",
                        exc_info=True)

    # -- answering (on the engine's event loop) -------------------------------------------------

    async def ask(self, items: list[PredictRequest], context: RequestContext, field: str = "items",
                  ids: list[str] | None = None) -> list[PredictResponse]:
        """The answers to one request's items (one adapter), as every door asks: readiness, the request's checks
        (off the loop), then :meth:`submit`. ``ids``: of answers whose item carries none (default
        ``<request id>-<position>``)."""
        self.require(context)
        checked = await self.off_loop(self.check_request, items, field)
        if checked:
            context.adapter = checked[0].runtime.name
        ids = ids or [f"{context.request_id}-{i}" for i in range(len(checked))]
        return await self.submit(checked, context, ids)

    async def ask_one(self, question: PredictRequest, context: RequestContext) -> PredictResponse:
        """The answer to a request of one question (``POST /predict``): its fields named as they are, its answer's
        id the request's when the question carries none."""
        self.require(context)
        context.adapter = self.runtime(question.adapter).name
        checked = await self.off_loop(self.check, question)
        (answer,) = await self.submit([checked], context, [context.request_id])
        return answer

    async def submit(self, checked: list[Checked], context: RequestContext,
                     ids: list[str] | None = None) -> list[PredictResponse]:
        """The answers to one request's checked questions (one adapter), scheduled with every other caller's, due
        by the request's deadline; its queued questions are dropped when the caller goes away. A refusal is told to
        the observers under its reason and raised as it is.

        Raises:
            Overloaded, QueueFull, NeedsTooLong, ShuttingDown: not admitted (each with its ``reason``).
            Timeout, DeadlineExceeded, Cancelled: admitted, not answered in time, or the caller went away.
            ModelError: the model's numbers were not finite (never an answer).
        """
        if not checked:
            return []
        try:
            return await self._submit(checked, context, ids)
        except ModelError as e:
            self.notify("model_error", e.nonfinite, context.request_id)
            log.error("the model gave non-finite numbers for %d of %d questions (request %s); not answered",
                      e.nonfinite, len(checked), context.request_id)
            raise
        except EngineError as e:
            if e.reason is not None:
                self.notify("refused", e.reason, len(checked))
            raise

    async def _submit(self, checked: list[Checked], context: RequestContext,
                      ids: list[str] | None) -> list[PredictResponse]:
        runtime = checked[0].runtime
        if any(c.runtime is not runtime for c in checked):
            raise ValueError("one request's questions must use one adapter runtime")
        deadline = self.deadline(context)
        own = deadline < context.arrived + self.settings.request_timeout_s  # the caller's deadline is shorter
        try:  # the runtime's own predict: passes never mix adapters, nor backends across a switch
            futures = await self.batcher.submit_many([c.question for c in checked], [c.tokens for c in checked],
                                                     None if deadline == math.inf else deadline, runtime.predict,
                                                     context.admitted)
        except NeedsTooLong as e:
            if own:  # the caller's own deadline is what cannot be met, not the request's size
                raise Timeout(f"{e.cause}; the caller's own deadline ({TIMEOUT_HEADER} over HTTP) cannot be met") \
                    from e
            raise
        preds = await self._wait(futures, deadline, context.gone)
        broken = [i for i, p in enumerate(preds) if not finite_prediction(p)]
        if broken:
            raise ModelError("the model produced non-finite numbers for "
                             + (f"items {broken}" if len(preds) > 1 else "this question") + "; it was not answered",
                             nonfinite=len(broken))
        ids = ids or [str(i) for i in range(len(checked))]
        answers = []
        for c, pred, answer_id in zip(checked, preds, ids, strict=True):
            answer = build_answer(c.runtime, c.request, c.question, pred, answer_id, self.feedback)
            self.notify("answered", c.runtime, c.question, pred, answer)
            answers.append(answer)
        return answers

    async def _wait(self, futures: list[asyncio.Future], deadline: float, gone) -> list[Prediction]:
        """The predictions of admitted questions, or why not: Timeout at the deadline, Cancelled when the caller
        went away, the scheduler's refusal after admission; either way the request's other questions are
        dropped so they do not keep the model busy."""
        everything = asyncio.gather(*futures)
        watch = asyncio.ensure_future(gone()) if gone is not None else None
        left = None if deadline == math.inf else max(0.0, deadline - self.admission.clock())
        try:
            done, _ = await asyncio.wait({everything} | ({watch} if watch else set()), timeout=left,
                                         return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the caller's task was cancelled (a gRPC call the client cancelled)
            everything.cancel()
            _cancel(futures)
            self.notify("refused", Cancelled.reason, len(futures))
            raise
        finally:
            if watch is not None:
                watch.cancel()
        if everything not in done:
            everything.cancel()
            _cancel(futures)
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await everything
            if watch is not None and watch in done:
                raise Cancelled("the client went away before the answer")
            raise Timeout("no answer before the request's deadline; the service is busy")
        try:
            return list(everything.result())
        except BaseException:  # refused after admission, or one question failed: its request-mates are dropped
            _cancel(futures)
            raise

    def _on_batch(self, size: int, seconds: float) -> None:
        self.notify("batch", size, seconds, self.batcher.service_time.per_token_s, self.batcher.overrun)

    # -- answering (from any thread) ------------------------------------------------------------

    def predict(self, questions: list[dict | PredictRequest | MCQuestion], adapter: str | None = None,
                batch_size: int | None = None, timeout_s: float | None = None) -> list[PredictResponse]:
        """Answers in input order, scheduled like every other caller's (threads sharing an engine take fair turns
        with each other and with the service's clients). Questions are checked first (all or none), then sent per
        adapter in requests of ``batch_size`` (default ``max_batch_size``), each admitted as a door's request is and
        due ``timeout_s`` seconds after it is sent (default: no deadline). TypeError for one question not in a list,
        ValueError for a ``batch_size`` under 1."""
        if isinstance(questions, (dict, str, PredictRequest, MCQuestion)):  # iterating it would read its keys
            raise TypeError(f"questions must be a list of questions, got one {type(questions).__name__}: pass "
                            "[question]")
        check_batch_size(batch_size)
        return self.answer([self.check(q, f"items.{i}.", adapter) for i, q in enumerate(questions)], batch_size,
                           timeout_s=timeout_s)

    def answer(self, checked: list[Checked], batch_size: int | None = None, ids: list[str] | None = None,
               timeout_s: float | None = None) -> list[PredictResponse]:
        """Answers to checked questions in order (``ids``: of those whose request has none; default position),
        sent per adapter in requests of ``batch_size``; see :meth:`predict`."""
        check_batch_size(batch_size)
        size = self.settings.max_batch_size if batch_size is None else batch_size
        ids = ids or [str(i) for i in range(len(checked))]
        answers: list[PredictResponse | None] = [None] * len(checked)
        for runtime in {id(c.runtime): c.runtime for c in checked}.values():
            mine = [i for i, c in enumerate(checked) if c.runtime is runtime]
            for start in range(0, len(mine), size):
                chunk = mine[start:start + size]

                async def one(chunk=chunk):
                    context = self.arrive(timeout=math.inf if timeout_s is None else timeout_s)
                    self.refuse_early(context)
                    return await self.submit([checked[i] for i in chunk], context, [ids[i] for i in chunk])

                for i, a in zip(chunk, self.call(one), strict=True):
                    answers[i] = a
        return answers  # type: ignore[return-value]

    def call(self, coroutine_fn: Callable):
        """``await coroutine_fn()`` on the engine's event loop from a thread that is not on it (started on a thread
        of its own the first time when no door started it), and its result."""
        loop = self._loop
        if loop is None or self.status == "stopped":
            with self._start_lock:  # stopped, or closed while this call waited for the lock
                if self.status == "stopped":
                    raise NotReady("the engine is stopped (closed); load it again", retry_after=None)
                if self._loop is None:
                    self._start_thread()
                loop = self._loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:  # no loop on this thread: the usual case
            running = None
        if running is loop:
            raise RuntimeError("a blocking Engine call was made on the engine's own event loop: await instead")
        return asyncio.run_coroutine_threadsafe(coroutine_fn(), loop).result()

    def _start_thread(self) -> None:
        loop = asyncio.new_event_loop()
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.run_until_complete(self.start())
            started.set()
            loop.run_forever()

        self._thread = threading.Thread(target=run, name="ibedl-engine", daemon=True)
        self._thread.start()
        started.wait()

    def close(self) -> None:
        """Stop the engine's own thread; an engine ``load`` made that never answered releases its model thread and
        feedback store here. A no-op when a door runs the engine on its loop (the door stops it)."""
        with self._start_lock:  # not while a first question starts the thread
            if self._loaded and self._loop is None and self.status != "stopped":  # never started: nothing to stop
                self._model.shutdown(wait=True)
                self.store.close(self.feedback.store)
                self.status, self.reason = "stopped", "the engine is closed"
                self.notify("readiness", False)
                return
        if self._thread is None or self._loop is None:
            return
        asyncio.run_coroutine_threadsafe(self.stop(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._thread = self._loop = None
        self.reason = "the engine is closed"

    # -- feedback -------------------------------------------------------------------------------

    async def record_labels(self, items: list[dict | FeedbackRequest], prefix: str = "",
                            credential: str | None = None) -> FeedbackResponse:
        """Record the right options of answered questions (each ``{"receipt", "label"}``), on the store's thread:
        all or none, at most ``max_batch_items``; a receipt keeps its first label; ``credential``: who sent them,
        counted against IBEDL_MAX_LABELS per IBEDL_LABEL_WINDOW_S (None: no quota). Raises the feedback errors of
        ``ibedl.engine.errors``."""
        limit = self.settings.max_batch_items
        if len(items) > limit:
            raise TooLarge(too_many_items(len(items), limit), "items")
        given = [as_feedback(x, f"{prefix}{i}." if prefix else "") for i, x in enumerate(items)]
        quota = None if credential is None else LabelQuota(credential, self.settings.max_labels,
                                                           self.settings.label_window_s)
        try:
            results = await self.store.run(self.feedback.record, served_versions(self.runtimes),
                                           [(x.receipt, x.label) for x in given], prefix, quota)
        except LabelConflict as e:
            self.notify("conflicts", e.adapters)
            log.warning("refused %d label(s) contradicting the first label of their receipt: %s", len(e.adapters),
                        e.message)
            raise
        recorded = sum(r["status"] == "recorded" for r in results)
        response = FeedbackResponse(recorded=recorded, duplicates=len(results) - recorded, results=results)
        self.notify("labels", response.results)
        return response

    async def realised(self, adapter: str | None = None, timeout: float | None = None) -> GuaranteesResponse:
        """The realised guarantees from the recorded labels (``adapter``: of that adapter only), read on the store's
        thread, waited for at most ``timeout`` seconds (StoreUnavailable; the observers hear of them when the store
        answers, even after the wait gave up)."""
        if adapter is not None:
            adapter = self.runtime(adapter).name

        def read() -> GuaranteesResponse:
            found = GuaranteesResponse(
                alpha=self.feedback.alpha, change_false_alarm=self.feedback.change_false_alarm,
                change_horizon=self.feedback.change_horizon, shared_store=self.feedback.shared,
                conflicts=dict(self.feedback.conflicts),
                guarantees=self.feedback.guarantees(served_versions(self.runtimes), adapter))
            self.notify("guarantees", [g.model_dump() for g in found.guarantees])
            return found

        return await self.store.run(read, timeout=timeout)

    def record_feedback(self, items: list[dict | FeedbackRequest], prefix: str = "",
                        credential: str | None = None) -> FeedbackResponse:
        """:meth:`record_labels` from any thread."""
        return self.call(lambda: self.record_labels(items, prefix, credential))

    def guarantees(self, adapter: str | None = None) -> GuaranteesResponse:
        """:meth:`realised` from any thread."""
        return self.call(lambda: self.realised(adapter))


def check_batch_size(batch_size: int | None) -> None:
    """ValueError naming ``batch_size`` (questions per request; None: the engine's default) unless it is at least 1."""
    if batch_size is None:
        return
    try:
        whole = operator.index(batch_size)  # an int, or numpy's integers; never a bool or a float
    except TypeError:
        whole = None
    if isinstance(batch_size, bool) or whole is None or whole < 1:
        raise ValueError(f"batch_size must be an integer >= 1 or None (the engine's default), got {batch_size!r}")


def as_request(question: dict | PredictRequest | MCQuestion, prefix: str = "") -> PredictRequest:
    """A request body from a dict (InvalidRequest naming the field when it is not one), a ``PredictRequest`` or an
    ``MCQuestion``."""
    if isinstance(question, PredictRequest):
        return question
    if isinstance(question, MCQuestion):
        question = {"question": question.question, "options": list(question.options), "context": question.context,
                    "id": question.id}
    return _validated(PredictRequest, question, prefix)


def as_feedback(item: dict | FeedbackRequest, prefix: str = "") -> FeedbackRequest:
    return item if isinstance(item, FeedbackRequest) else _validated(FeedbackRequest, item, prefix)


def _validated(model, value, prefix: str):
    """``model.model_validate(value)``; its ValidationError as the engine's InvalidRequest naming the first field."""
    try:
        return model.model_validate(value)
    except ValidationError as e:
        message, field = described(e.errors())
        raise InvalidRequest(message, (prefix + (field or "")) or None) from None


def _cancel(futures: list[asyncio.Future]) -> None:
    for f in futures:
        f.cancel()
