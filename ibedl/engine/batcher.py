"""Micro-batching with fair turns and admission by capacity.

Each request's questions wait in a queue of their own; a single worker task builds a forward pass by taking
one question from each waiting request in turn (round robin), for at most ``max_wait_ms`` after the first,
until the pass holds ``max_batch_size`` questions or ``max_batch_tokens`` prompt tokens. A request may name
the model that answers it (``submit_many(..., predict=...)``, one per served adapter): a pass holds the
questions of one model only, so adapters never share a forward pass, and every pass runs on the one worker
thread, so passes of different adapters of a shared base model never overlap. So a large batch
request shares the model with small requests that arrive after it instead of holding it until it is done.

A request is admitted only if it can be answered before its deadline: :class:`ibedl.engine.admission.Admission`
decides from a snapshot of the queue (its expected completion, the pass in flight plus its turns among the queued
requests, :func:`ibedl.engine.capacity.round_robin_wait`, times a safety margin, must fit); a refusal is raised at once
as an engine error (``ibedl.engine.errors``: ``Overloaded`` with the seconds after which it would fit, ``NeedsTooLong``,
``QueueFull`` or ``ShuttingDown``, each carrying the reason it is counted under). Every time the batcher reads
comes from the admission's clock.
Before each pass, a queued request that the current estimate says can no longer finish in time is answered
:class:`Overloaded` then rather than timing out later. Questions whose request was abandoned (future
cancelled: client gone or timed out) or whose deadline passed are dropped before they reach the model. On
shutdown (:meth:`MicroBatcher.begin_drain`), no new request is admitted, queued requests that cannot finish
within the grace period fail with :class:`ShuttingDown`, and the rest are answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time  # perf_counter: how long a pass took (the admission clock gives every other time)
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ibedl.core.predictor import Prediction
from ibedl.core.prompt import MCQuestion
from ibedl.engine.admission import Admission, QueueSnapshot
from ibedl.engine.capacity import ServiceTime, round_robin_finish, round_robin_wait
from ibedl.engine.errors import DeadlineExceeded, Overloaded, ShuttingDown

log = logging.getLogger("ibedl.engine.batcher")


OVERRUN_MAX = 4.0  # the overrun factor's cap (see MicroBatcher._observe_wait)
SIMILAR = 2.0  # questions share a pass only if their prompt lengths are within this factor of its first one's


Predict = Callable[[list[MCQuestion]], list[Prediction]]


@dataclass(eq=False)
class _Item:
    question: MCQuestion
    tokens: int
    future: asyncio.Future
    deadline: float
    predict: Predict
    owner: _Request | None = None


@dataclass(eq=False)
class _Request:
    predict: Predict
    seq: int  # arrival order
    items: deque[_Item] = field(default_factory=deque)
    served: int = 0  # prompt tokens of its questions taken into passes so far
    admitted_at: float = 0.0  # monotonic
    expected_s: float = 0.0  # the wait the estimate expected at admission (without margin or overrun)

    def turn(self) -> tuple[int, int]:
        """Scheduling key: the least served first, then the earliest."""
        return self.served, self.seq

    def live(self) -> list[int]:
        """Prompt tokens of the questions still wanted, in order."""
        return [i.tokens for i in self.items if not i.future.done()]

    def deadline(self) -> float:
        return self.items[0].deadline if self.items else float("inf")


class MicroBatcher:
    """Groups submitted questions into forward passes of ``predict(list[MCQuestion]) -> list[Prediction]``.

    Args:
        predict: answers a list of questions in order (runs in the worker thread); the default model of a
            request that names none.
        max_batch_size: questions per forward pass.
        max_batch_tokens: prompt tokens per forward pass (a single longer question still runs alone).
        max_wait_ms: how long a pass waits for more questions after its first.
        queue_size: questions waiting, at most.
        similar: questions share a pass only if their prompt lengths are within this factor of its first one's
            (``math.inf``: whatever their lengths).
        service_time: the per-token time estimate (updated from every pass); a fresh one admits everything
            until the first pass is measured.
        admission: the admission policy (its ``margin``: admission requires that many times the expected completion
            to fit before the deadline) and the clock the batcher reads; default: no server timeout, margin 1.
        executor: the model's thread, on which every pass and :meth:`between_passes` run (one worker; default: one
            of the batcher's own, shut down when it stops). The engine gives the thread it loaded the model on (see
            :class:`ibedl.engine.engine.Engine`) and shuts it down itself.
        on_batch: called with (questions, seconds) after every pass.
        on_depth: called with the number of waiting questions when it changes.
    """

    def __init__(self, predict: Predict, max_batch_size: int = 16,
                 max_wait_ms: float = 5.0, queue_size: int = 256, on_batch: Callable[[int, float], None] | None = None,
                 on_depth: Callable[[int], None] | None = None, max_batch_tokens: int = 1 << 30,
                 service_time: ServiceTime | None = None, admission: Admission | None = None,
                 executor: ThreadPoolExecutor | None = None, similar: float = SIMILAR) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        if not similar >= 1:
            raise ValueError(f"similar must be >= 1, got {similar}")
        self.predict = predict
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.similar = similar
        self.max_wait = max_wait_ms / 1000.0
        self.queue_size = queue_size
        self.service_time = service_time or ServiceTime()
        self.admission = admission or Admission()
        self.clock = self.admission.clock
        self.margin = self.admission.margin
        self.on_batch = on_batch or (lambda size, seconds: None)
        self.on_depth = on_depth or (lambda depth: None)
        self._requests: deque[_Request] = deque()  # in turn order: the head gives the next question
        self._arrivals = 0
        self.overrun = 1.0  # how much longer than estimated requests have recently taken (>= 1)
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._shedder: asyncio.Task | None = None  # sheds hopeless queued requests between passes too
        self._busy = False  # a gathered batch is being answered
        self._busy_until = 0.0  # monotonic time the pass in flight is expected to end
        self._backlog_since: float | None = None  # end of the last pass, when questions were waiting at its end
        self._stopping = False
        self._draining = False
        self._drain_timer: asyncio.TimerHandle | None = None
        self._drain_end: float | None = None  # monotonic time queued work is refused from
        self._own_executor = executor is None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="predict") if executor is None \
            else executor

    # -- state ------------------------------------------------------------------------------------

    @property
    def depth(self) -> int:
        """Questions waiting (abandoned ones included until the worker drops them)."""
        return sum(len(r.items) for r in self._requests)

    @property
    def running(self) -> bool:
        """True from start() until stop() has begun."""
        return self._task is not None and not self._task.done() and not self._stopping

    @property
    def draining(self) -> bool:
        return self._draining

    def inflight_left(self) -> float:
        """Expected seconds left of the forward pass running now (0 when idle)."""
        return max(0.0, self._busy_until - self.clock()) if self._busy else 0.0

    def snapshot(self, tokens: list[int]) -> QueueSnapshot:
        """The queue as admission sees it, for a new request of these prompt tokens (one count per question)."""
        return QueueSnapshot(depth=self.depth, queue_size=self.queue_size, expected_wait_s=self.expected_wait(tokens),
                        alone_s=self.service_time.seconds(sum(tokens)), overrun=self.overrun,
                        draining=self._draining, drain_end=self._drain_end, stopping=self._stopping)

    def expected_wait(self, tokens: list[int]) -> float:
        """Expected seconds until a new request (prompt tokens of each question) would be answered."""
        return round_robin_wait(tokens, [r.live() for r in self._requests], self.inflight_left(), self.service_time)

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        self._wakeup = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run(), name="micro-batcher")
        self._shedder = loop.create_task(self._shed_periodically(), name="micro-batcher-shedder")

    def begin_drain(self, grace_s: float) -> None:
        """Stop admitting; fail (ShuttingDown) the queued requests that cannot finish within ``grace_s``, and
        whatever is still queued one second before it ends; answer the rest."""
        if self._draining:
            return
        self._draining = True
        end = grace_s - min(1.0, grace_s / 10)
        requests = self._in_turn()
        finish = round_robin_finish([r.live() for r in requests], self.inflight_left(), self.service_time)
        late = [r for r, t in zip(requests, finish, strict=True) if self.margin * t > end]
        for r in late:
            self._fail(r, ShuttingDown("the service is shutting down and could not answer this request in time"))
        if late:
            log.info("draining: %d queued requests cannot finish within %.1f s and get 503", len(late), grace_s)
        self._drain_end = self.clock() + max(0.0, end)
        self._drain_timer = asyncio.get_running_loop().call_later(max(0.0, end), self._fail_all_queued)
        self._signal()

    async def stop(self) -> None:
        """Answer what is queued and the batch in flight, then stop the worker."""
        self._stopping = True
        if self._task is not None:
            while (self._live_depth() or self._busy) and not self._task.done():
                await asyncio.sleep(0.01)
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._shedder is not None:
            self._shedder.cancel()
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        if self._own_executor:
            await asyncio.to_thread(self._executor.shutdown, wait=True)

    # -- submitting -------------------------------------------------------------------------------

    async def submit_many(self, questions: list[MCQuestion], tokens: list[int] | None = None,
                          deadline: float | None = None, predict: Predict | None = None,
                          admitted_before_drain: bool = False) -> list[asyncio.Future]:
        """Queue all questions of one request, or none. Returns one future per question.

        Args:
            questions: the request's questions, answered in this order.
            tokens: prompt tokens of each question (default 1 each: admission by count only).
            deadline: the admission clock's time by which the request must be answered (default: none).
            predict: the model that answers them (default: the batcher's); passes never mix models.
            admitted_before_drain: the request arrived before a drain began (its route ran later): it is still
                queued if it can finish within the grace period.

        Raises:
            ShuttingDown: the service is draining.
            QueueFull: the questions do not fit in the queue.
            NeedsTooLong: the request alone needs more model time than its deadline leaves.
            Overloaded: it would not be answered before its deadline now; ``retry_after`` says when it would.
        """
        if self._wakeup is None:
            raise RuntimeError("the batcher is not started")
        tokens = [1] * len(questions) if tokens is None else list(tokens)
        if len(tokens) != len(questions):
            raise ValueError(f"{len(tokens)} token counts for {len(questions)} questions")
        deadline = float("inf") if deadline is None else deadline
        queue = self.snapshot(tokens)
        refusal = self.admission.decide(len(questions), sum(tokens), deadline, queue, admitted_before_drain)
        if refusal is not None:
            raise refusal
        loop = asyncio.get_running_loop()
        self._arrivals += 1
        request = _Request(predict or self.predict, self._arrivals, admitted_at=self.clock(),
                           expected_s=queue.expected_wait_s)
        futures = []
        for q, n in zip(questions, tokens, strict=True):
            fut = loop.create_future()
            request.items.append(_Item(q, n, fut, deadline, request.predict, request))
            futures.append(fut)
        self._requests.append(request)
        self.on_depth(self.depth)
        self._signal()
        return futures

    async def between_passes(self, fn: Callable[[], object], idle_wait_s: float = 2.0):
        """``fn()`` on the model's thread between two passes (never during one), once no question waits or after
        ``idle_wait_s``: background work on the model (a timing call, a switch of backend) delays answers by one
        call of it at most. Returns what ``fn`` returns."""
        end = self.clock() + idle_wait_s
        while (self._live_depth() or self._busy) and self.clock() < end:
            await asyncio.sleep(0.01)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    # -- the worker -------------------------------------------------------------------------------

    def _signal(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def _live_depth(self) -> int:
        return sum(1 for r in self._requests for i in r.items if not i.future.done())

    def _fail(self, request: _Request, error: Exception) -> None:
        for item in request.items:
            if not item.future.done():
                item.future.set_exception(error)
        request.items.clear()

    def _observe_wait(self, ratio: float) -> None:
        """Fold in how long a finished request took against what its estimate expected at admission. The
        ``overrun`` factor rises at once toward a late ratio and falls back slowly, and multiplies the waits that
        admission and shedding estimate: when the estimate runs behind the machine (other work takes the CPU),
        admission becomes stricter before requests start to time out."""
        if not math.isfinite(ratio):
            return
        step = 0.5 if ratio > self.overrun else 0.05
        self.overrun = min(OVERRUN_MAX, max(1.0, self.overrun + step * (ratio - self.overrun)))

    def _shed_late(self) -> None:
        """Answer Overloaded now to each queued request the current estimate says will miss its deadline (served
        in turn order after the pass in flight), rather than 504 at the deadline."""
        now = self.clock()
        requests = self._in_turn()
        finish = round_robin_finish([r.live() for r in requests], self.inflight_left(), self.service_time)
        late = [r for r, t in zip(requests, finish, strict=True) if now < r.deadline() < now + self.overrun * t]
        if len(requests) == 1 and not self._busy and late and now + finish[0] <= late[0].deadline():
            late = []  # alone, and it fits at the estimated speed: the overrun (others' waits) never sheds it
        for r in late:
            self._fail(r, Overloaded("the service slowed down and could not answer this request before its deadline",
                                     retry_after=1.0))
        if late:
            log.warning("%d queued requests would miss their deadline; answered 503 now", len(late))

    async def _shed_periodically(self, every_s: float = 0.25) -> None:
        while True:
            await asyncio.sleep(every_s)
            self._shed_late()

    def _fail_all_queued(self) -> None:
        waiting = [r for r in self._requests if r.live()]
        for r in waiting:
            self._fail(r, ShuttingDown("the grace period ended before this request was answered"))
        if waiting:
            log.warning("drain grace period ending: %d queued requests get 503", len(waiting))
        self._signal()

    def _purge(self) -> None:
        """Drop abandoned questions and those whose deadline passed (DeadlineExceeded), and empty requests."""
        now = self.clock()
        for request in list(self._requests):
            while request.items and (request.items[0].future.done() or request.items[0].deadline <= now):
                item = request.items.popleft()
                if not item.future.done():
                    item.future.set_exception(DeadlineExceeded("the deadline passed while the question was queued"))
            if not request.items:
                self._requests.remove(request)

    def _take(self, request: _Request) -> _Item:
        """The request's next question (counted as served)."""
        item = request.items.popleft()
        request.served += item.tokens
        if not request.items:
            self._requests.remove(request)
        return item

    def _in_turn(self) -> list[_Request]:
        """Waiting requests in turn order: the least served first (so each request gets its next question before
        any gets a second one beyond it), then the earliest: first come, first served for one-question requests."""
        return sorted(self._requests, key=_Request.turn)

    def _first(self) -> _Item | None:
        """The question a new pass starts with: of a request that cannot afford to wait another pass (least
        slack first), else of the first request in turn order; a small request that arrives behind a large one
        has been served less, so it goes next, in a pass of questions of its own length."""
        self._purge()
        if not self._requests:
            return None
        now = self.clock()
        one_pass = self.service_time.seconds(self.max_batch_tokens)

        def slack(r: _Request) -> float:
            return r.deadline() - now - self.margin * self.service_time.seconds(sum(r.live()))

        at_risk = [r for r in self._requests if slack(r) < one_pass]
        chosen = min(at_risk, key=slack) if at_risk else min(self._requests, key=_Request.turn)
        return self._take(chosen)

    def _next(self, first: _Item, room_tokens: int, ends_by: float, size: int = 1, longest: int = 0) -> _Item | None:
        """The next question in turn order that may share ``first``'s pass (of ``size`` questions, the longest of
        ``longest`` tokens): the same model, at most ``room_tokens`` tokens, of a similar length (within ``similar``
        times), and not making the pass end after ``ends_by`` (the earliest deadline in it) or after its own deadline;
        or None. Without the similarity rule (``similar`` infinite) the pass runs as one forward padded to its
        longest prompt, so its padded tokens, not only its real ones, stay within ``max_batch_tokens``."""
        self._purge()
        now = self.clock()
        for request in self._in_turn():
            head = request.items[0]
            if request.predict != first.predict or head.tokens > room_tokens:  # bound methods: equal per object
                continue
            if not first.tokens / self.similar <= head.tokens <= first.tokens * self.similar:
                continue
            if math.isinf(self.similar) and (size + 1) * max(longest, head.tokens) > self.max_batch_tokens:
                continue
            if (now + self.service_time.seconds(self.max_batch_tokens - room_tokens + head.tokens)
                    > min(ends_by, head.deadline)):
                continue
            return self._take(request)
        return None

    async def _gather(self) -> list[_Item]:
        assert self._wakeup is not None
        self._shed_late()
        while True:
            first = self._first()
            if first is not None:
                break
            self.on_depth(self.depth)
            self._backlog_since = None  # idle: the next pass's time starts at the pass
            self._wakeup.clear()
            await self._wakeup.wait()
        self._busy = True  # from the first question taken: stop() must wait for it
        batch, tokens, longest = [first], first.tokens, first.tokens
        deadline = self.clock() + self.max_wait
        while len(batch) < self.max_batch_size:
            item = self._next(first, self.max_batch_tokens - tokens, min(i.deadline for i in batch), len(batch),
                              longest)
            if item is not None:
                batch.append(item)
                tokens += item.tokens
                longest = max(longest, item.tokens)
                continue
            if self._live_depth():
                break  # what waits does not fit in this pass, is much longer or shorter, or for another model
            remaining = deadline - self.clock()
            if remaining <= 0:
                break
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except (asyncio.TimeoutError, TimeoutError):
                break
        return batch

    async def _run(self) -> None:
        while True:
            batch = await self._gather()
            try:
                await self._answer(batch)
            finally:
                self._busy = False
                batch = None  # the pass's items (their runtime's predict) go now, not at the next pass

    async def _answer(self, batch: list[_Item]) -> None:
        loop = asyncio.get_running_loop()
        self.on_depth(self.depth)
        live = [item for item in batch if not item.future.done()]  # abandoned requests are skipped
        # A question whose deadline falls before this pass is expected to end gets its 503 now, not a 504 later.
        end = self.clock() + self.service_time.seconds(sum(i.tokens for i in live))
        for item in [i for i in live if i.deadline < end]:
            item.future.set_exception(Overloaded("the service is busy: this question would not be answered before "
                                                 "its deadline", retry_after=1.0))
        live = [item for item in live if not item.future.done()]
        if not live:
            self._backlog_since = None
            return
        tokens = sum(i.tokens for i in live)
        self._busy_until = self.clock() + self.service_time.seconds(tokens)
        # Under a backlog the time a question costs is from the end of the last pass to the end of this one:
        # gathering and whatever else the CPU ran in between count too.
        since = self._backlog_since
        start = time.perf_counter()
        try:
            results = await loop.run_in_executor(self._executor, live[0].predict, [i.question for i in live])
        except Exception as e:
            if len(live) > 1:
                # One bad question must not fail the others it happened to share a batch with.
                log.warning("batch of %d failed (%s); answering its questions one by one", len(live), e)
                for item in live:
                    await self._answer([item])
                return
            log.exception("question failed")  # answered as a 500, logged here
            if not live[0].future.done():
                live[0].future.set_exception(e)
            return
        end = time.perf_counter()
        seconds = end - start
        # the gap before a pass counts only while it is short beside the pass (gathering, the event loop's work)
        backlogged = since is not None and 0 <= start - since <= max(0.5, seconds)
        self.service_time.observe(tokens, end - since if backlogged else seconds)
        self._backlog_since = end if self._live_depth() else None
        self.on_batch(len(live), seconds)
        for item, result in zip(live, results, strict=True):
            if not item.future.done():
                item.future.set_result(result)
        now = self.clock()
        for owner in {id(i.owner): i.owner for i in live if i.owner is not None and not i.owner.items}.values():
            # relative to at least 1 s: a short wait's fixed costs (gathering, the thread hop) are not an overrun
            self._observe_wait(1.0 + (now - owner.admitted_at - owner.expected_s) / max(owner.expected_s, 1.0))
