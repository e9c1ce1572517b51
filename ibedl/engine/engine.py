"""The engine: the served adapters, the scheduler that answers them (admission, fair turns, batching, capacity,
deadlines) and labelled feedback. Every front door calls one :class:`Engine`: the Python API (``ibedl.api``,
synchronous), the HTTP service (``ibedl.serve``, on its event loop) and the Open Inference Protocol
(``ibedl.serve.oip``); none repeats the answer, feedback or guarantees logic.

    engine = Engine.load(EngineSettings(artifacts=[Path("artifacts/default")]))
    engine.predict([{"question": "...", "options": ["...", "..."]}])        # from any thread: scheduled
    await engine.submit(engine.check_request(items), deadline=...)          # on the engine's event loop

What a front door adds stays with it: the service its metrics, drift monitors and accuracy estimates (it
registers an ``answer_hook``), HTTP statuses (``ibedl.serve.errors.STATUS``), credentials and label quotas.
Refusals are the engine's errors (``ibedl.engine.errors``); a scheduler refusal carries the ``reason`` it is
counted under.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ibedl.core.predictor import Prediction
from ibedl.core.prompt import MCQuestion
from ibedl.engine.admission import Admission
from ibedl.engine.batcher import MicroBatcher
from ibedl.engine.capacity import ServiceTime, warm_up
from ibedl.engine.errors import Cancelled, InvalidRequest, ModelError, NeedsTooLong, Timeout, TooLarge
from ibedl.engine.feedback import Feedback, LabelQuota, served_versions
from ibedl.engine.requests import to_question
from ibedl.engine.responses import build_answer, model_card
from ibedl.engine.runtime import AdapterRuntime, find_adapter, finite_prediction, load_predictors, make_runtimes
from ibedl.engine.schemas import FeedbackRequest, FeedbackResponse, GuaranteesResponse, PredictRequest, PredictResponse
from ibedl.engine.settings import EngineSettings

# Called with every answer the engine gives: (runtime, question, prediction, answer). The service records its
# metrics, drift window and accuracy estimate in one; the engine keeps none of them.
AnswerHook = Callable[[AdapterRuntime, MCQuestion, Prediction, PredictResponse], None]


@dataclass
class Checked:
    """A question the engine accepts: its adapter, request body, parsed question and prompt tokens."""

    runtime: AdapterRuntime
    request: PredictRequest
    question: MCQuestion
    tokens: int


class Engine:
    """The served adapters on one base model, their scheduler and their feedback.

    Args:
        runtimes: the adapters by name, the default first (``ibedl.engine.runtime.make_runtimes``).
        settings: the engine's settings (limits, scheduler, feedback).
        feedback: receipts out, labels in (default: from ``settings``; bound to ``runtimes`` by the caller, since
            opening a store may wait).
        service_time: the first estimate of seconds per prompt token (default: unknown, learnt from the passes).
        admission: the admission policy (default: from ``settings``, on ``time.monotonic``; tests and the service give
            their own, with its clock).
        on_batch, on_depth: the batcher's observers (pass size and seconds; queue depth).
    """

    def __init__(self, runtimes: dict[str, AdapterRuntime], settings: EngineSettings, feedback: Feedback | None = None,
                 service_time: ServiceTime | None = None, admission: Admission | None = None,
                 on_batch: Callable[[int, float], None] | None = None,
                 on_depth: Callable[[int], None] | None = None) -> None:
        if not runtimes:
            raise ValueError("an engine needs at least one adapter runtime")
        self.runtimes = runtimes
        self.settings = settings
        self.feedback = Feedback(settings) if feedback is None else feedback
        self.admission = admission or Admission(settings.request_timeout_s, settings.admission_margin)
        self.batcher = MicroBatcher(
            self.default.predict, settings.max_batch_size, settings.max_wait_ms, settings.queue_size,
            on_batch=on_batch, on_depth=on_depth, max_batch_tokens=settings.max_batch_tokens,
            service_time=service_time or ServiceTime(), admission=self.admission)
        self.answer_hooks: list[AnswerHook] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    @classmethod
    def load(cls, settings: EngineSettings) -> Engine:
        """The adapters of ``settings`` loaded on one base model, timed once (the scheduler's first estimate), with
        their feedback store opened: what the Python API serves."""
        runtimes = make_runtimes(load_predictors(settings), settings)
        engine = cls(runtimes, settings, service_time=warm_up([rt.predictor for rt in runtimes.values()]))
        engine.feedback.bind(runtimes)
        return engine

    # -- adapters -------------------------------------------------------------------------------

    @property
    def default(self) -> AdapterRuntime:
        """The adapter a question that names none gets (the first loaded)."""
        return next(iter(self.runtimes.values()))

    def runtime(self, name: str | None, field: str = "adapter") -> AdapterRuntime:
        """The adapter called ``name`` (None: the default); UnknownAdapter naming the served ones otherwise."""
        return find_adapter(self.runtimes, name, field)

    def cards(self) -> list[dict]:
        """What ``GET /v1/models`` says of each adapter."""
        return [model_card(rt, self.settings, self.feedback.suspension(rt)) for rt in self.runtimes.values()]

    # -- checking -------------------------------------------------------------------------------

    def check(self, question: dict | PredictRequest | MCQuestion, prefix: str = "",
              adapter: str | None = None) -> Checked:
        """A question checked against the engine's limits (``EngineError`` or ``pydantic.ValidationError`` if it
        breaks one); ``adapter``: the adapter of a question that names none. Counts its prompt's tokens (milliseconds
        of CPU: the service calls it off its event loop)."""
        req = as_request(question)
        runtime = self.runtime(req.adapter or adapter, prefix + "adapter")
        q, tokens = to_question(runtime, self.settings, req, prefix)
        return Checked(runtime, req, q, tokens)

    def check_request(self, items: list[PredictRequest], field: str = "items") -> list[Checked]:
        """The items of one request, checked: at most ``max_batch_items``, one adapter, at most
        ``max_request_tokens`` prompt tokens in all. ``field`` names the items in refusals."""
        limit = self.settings.max_batch_items
        if len(items) > limit:
            raise TooLarge(f"{len(items)} items; the limit is {limit}", field)
        names = {self.runtime(item.adapter, f"{field}.{i}.adapter").name for i, item in enumerate(items)}
        if len(names) > 1:
            raise InvalidRequest(f"the items of one batch must use one adapter, got {sorted(names)}; send one batch "
                                 "per adapter", field)
        checked = [self.check(item, f"{field}.{i}.") for i, item in enumerate(items)]
        budget = self.settings.max_request_tokens
        total = sum(c.tokens for c in checked)
        if total > budget:
            raise TooLarge(f"the items' prompts are {total} tokens in all; the limit per request is {budget}: "
                           "send them in smaller batches", field)
        return checked

    # -- answering (on the engine's event loop) -------------------------------------------------

    async def start(self) -> None:
        """Start the scheduler on the running event loop (the service's; the Python API's own thread)."""
        self._loop = asyncio.get_running_loop()
        self.batcher.start()

    async def submit(self, checked: list[Checked], deadline: float | None = None, ids: list[str] | None = None,
                     deadline_name: str | None = None, admitted_before_drain: bool = False,
                     gone: Callable[[], Awaitable] | None = None) -> list[PredictResponse]:
        """The answers to one request's questions (one adapter), scheduled with every other caller's.

        Args:
            checked: the request's questions (:meth:`check_request`), answered in this order.
            deadline: the admission clock's time by which they must be answered (None: none).
            ids: the ``id`` of an answer whose request carries none (default: its position).
            deadline_name: set when the deadline is the caller's own, shorter than the engine's (the service: its
                ``X-Request-Timeout``): a request too long for it is a Timeout saying that ``deadline_name`` cannot
                be met, rather than an overload.
            admitted_before_drain: the request arrived before a drain began; it is answered if it can finish.
            gone: gives an awaitable that completes when the caller goes away (its queued questions are dropped).

        Raises:
            Overloaded, QueueFull, NeedsTooLong, ShuttingDown: not admitted (each with its ``reason``).
            Timeout, DeadlineExceeded, Cancelled: admitted, not answered in time, or the caller went away.
            ModelError: the model's numbers were not finite (never an answer).
        """
        if not checked:
            return []
        runtime = checked[0].runtime
        if any(c.runtime is not runtime for c in checked):
            raise ValueError("one request's questions must use one adapter runtime")
        try:  # the runtime's own predict: passes never mix adapters, nor backends across a switch
            futures = await self.batcher.submit_many([c.question for c in checked], [c.tokens for c in checked],
                                                     deadline, runtime.predict, admitted_before_drain)
        except NeedsTooLong as e:
            if deadline_name:  # the caller's own deadline is what cannot be met, not the request's size
                raise Timeout(f"{e.cause}; its {deadline_name} cannot be met") from e
            raise
        preds = await self._wait(futures, deadline, gone)
        broken = [i for i, p in enumerate(preds) if not finite_prediction(p)]
        if broken:
            raise ModelError("the model produced non-finite numbers for "
                             + (f"items {broken}" if len(preds) > 1 else "this question") + "; it was not answered",
                             nonfinite=len(broken))
        ids = ids or [str(i) for i in range(len(checked))]
        answers = []
        for c, pred, answer_id in zip(checked, preds, ids, strict=True):
            answer = build_answer(c.runtime, c.request, c.question, pred, answer_id, self.feedback)
            for hook in self.answer_hooks:
                hook(c.runtime, c.question, pred, answer)
            answers.append(answer)
        return answers

    async def _wait(self, futures: list[asyncio.Future], deadline: float | None,
                    gone: Callable[[], Awaitable] | None) -> list[Prediction]:
        """The predictions of admitted questions, or why not: Timeout at the deadline, Cancelled when the caller
        went away, the scheduler's refusal after admission; either way the request's other questions are
        dropped so they do not keep the model busy."""
        everything = asyncio.gather(*futures)
        watch = asyncio.ensure_future(gone()) if gone is not None else None
        left = None if deadline is None else max(0.0, deadline - self.admission.clock())
        try:
            done, _ = await asyncio.wait({everything} | ({watch} if watch else set()), timeout=left,
                                         return_when=asyncio.FIRST_COMPLETED)
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

    def begin_drain(self, grace_s: float) -> None:
        """Stop admitting; answer what can finish within ``grace_s`` seconds."""
        self.batcher.begin_drain(grace_s)

    async def stop(self) -> None:
        await self.batcher.stop()

    # -- answering (from any thread) ------------------------------------------------------------

    def predict(self, questions: list[dict | PredictRequest | MCQuestion], adapter: str | None = None,
                batch_size: int | None = None, timeout_s: float | None = None) -> list[PredictResponse]:
        """Answers in input order, scheduled like every other caller's (threads sharing an engine take fair turns
        with each other and with HTTP clients). Questions are checked first (all or none), then sent per adapter
        in requests of ``batch_size`` (default ``max_batch_size``), each due ``timeout_s`` seconds after it is sent
        (default: no deadline). Raises what :meth:`check` and :meth:`submit` raise."""
        return self.answer([self.check(q, f"items.{i}.", adapter) for i, q in enumerate(questions)], batch_size,
                           timeout_s=timeout_s)

    def answer(self, checked: list[Checked], batch_size: int | None = None, ids: list[str] | None = None,
               timeout_s: float | None = None) -> list[PredictResponse]:
        """Answers to checked questions in order (``ids``: of those whose request has none; default position),
        sent per adapter in requests of ``batch_size``; see :meth:`predict`."""
        size = batch_size or self.settings.max_batch_size
        if size < 1:
            raise ValueError(f"batch_size must be >= 1, got {size}")
        ids = ids or [str(i) for i in range(len(checked))]
        answers: list[PredictResponse | None] = [None] * len(checked)
        for runtime in {id(c.runtime): c.runtime for c in checked}.values():
            mine = [i for i, c in enumerate(checked) if c.runtime is runtime]
            for start in range(0, len(mine), size):
                chunk = mine[start:start + size]

                async def one(chunk=chunk):
                    deadline = None if timeout_s is None else self.admission.clock() + timeout_s
                    return await self.submit([checked[i] for i in chunk], deadline, [ids[i] for i in chunk])

                for i, a in zip(chunk, self.call(one), strict=True):
                    answers[i] = a
        return answers  # type: ignore[return-value]

    def call(self, coroutine_fn: Callable[[], Awaitable]):
        """``await coroutine_fn()`` on the engine's event loop from a thread that is not on it (started on a thread
        of its own the first time when no front door started it), and its result."""
        loop = self._loop
        if loop is None:
            with self._start_lock:
                if self._loop is None:
                    self._start_thread()
                loop = self._loop
        with contextlib.suppress(RuntimeError):
            if asyncio.get_running_loop() is loop:
                raise RuntimeError("Engine.predict was called on the engine's own event loop: await submit instead")
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
        """Stop the engine's own thread (a no-op when a front door runs the engine on its loop)."""
        if self._thread is None or self._loop is None:
            return
        asyncio.run_coroutine_threadsafe(self.stop(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._thread = self._loop = None

    # -- feedback -------------------------------------------------------------------------------

    def record_feedback(self, items: list[dict | FeedbackRequest], prefix: str = "",
                        quota: LabelQuota | None = None) -> FeedbackResponse:
        """Record the right options of answered questions (each ``{"receipt", "label"}``): all or none; a receipt
        keeps its first label; ``quota``: the labelling credential's (the service's; None: no quota). Waits for the
        store (the service calls it on the store's thread). Raises the feedback errors of ``ibedl.engine.errors``."""
        given = [x if isinstance(x, FeedbackRequest) else FeedbackRequest.model_validate(x) for x in items]
        results = self.feedback.record(served_versions(self.runtimes), [(x.receipt, x.label) for x in given], prefix,
                                       quota)
        recorded = sum(r["status"] == "recorded" for r in results)
        return FeedbackResponse(recorded=recorded, duplicates=len(results) - recorded, results=results)

    def guarantees(self, adapter: str | None = None) -> GuaranteesResponse:
        """The realised guarantees from the recorded labels (``adapter``: of that adapter only); waits for the
        store."""
        if adapter is not None:
            adapter = self.runtime(adapter).name
        return GuaranteesResponse(alpha=self.feedback.alpha, change_false_alarm=self.feedback.change_false_alarm,
                                  change_horizon=self.feedback.change_horizon, shared_store=self.feedback.shared,
                                  conflicts=dict(self.feedback.conflicts),
                                  guarantees=self.feedback.guarantees(served_versions(self.runtimes), adapter))


def as_request(question: dict | PredictRequest | MCQuestion) -> PredictRequest:
    """A request body from a dict (validated), a ``PredictRequest`` or an ``MCQuestion``."""
    if isinstance(question, PredictRequest):
        return question
    if isinstance(question, MCQuestion):
        return PredictRequest(question=question.question, options=list(question.options), context=question.context,
                              id=question.id)
    return PredictRequest.model_validate(question)


def _cancel(futures: list[asyncio.Future]) -> None:
    for f in futures:
        f.cancel()
