"""Micro-batching: concurrent questions are grouped into one forward pass.

A single worker task takes the first waiting question, gathers more for at most ``max_wait_ms`` (or
until ``max_batch_size``), and runs the predictor in a dedicated thread. The queue is bounded: when
full, submitting fails at once with :class:`QueueFullError` (the API answers 503 + Retry-After).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from evidential.predictor import Prediction
from evidential.prompt import MCQuestion

log = logging.getLogger("service.batcher")


class QueueFullError(RuntimeError):
    pass


@dataclass
class _Item:
    question: MCQuestion
    future: asyncio.Future


class MicroBatcher:
    """Groups submitted questions into batches for ``predict(list[MCQuestion]) -> list[Prediction]``."""

    def __init__(self, predict: Callable[[list[MCQuestion]], list[Prediction]], max_batch_size: int = 16,
                 max_wait_ms: float = 5.0, queue_size: int = 256, on_batch: Callable[[int, float], None] | None = None,
                 on_depth: Callable[[int], None] | None = None) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        self.predict = predict
        self.max_batch_size = max_batch_size
        self.max_wait = max_wait_ms / 1000.0
        self.queue_size = queue_size
        self.on_batch = on_batch or (lambda size, seconds: None)
        self.on_depth = on_depth or (lambda depth: None)
        self._queue: asyncio.Queue[_Item] | None = None
        self._task: asyncio.Task | None = None
        self._busy = False  # a gathered batch is being answered
        self._stopping = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="predict")

    @property
    def depth(self) -> int:
        return self._queue.qsize() if self._queue else 0

    @property
    def running(self) -> bool:
        """True from start() until stop() has begun."""
        return self._task is not None and not self._task.done() and not self._stopping

    def start(self) -> None:
        self._queue = asyncio.Queue(maxsize=self.queue_size)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="micro-batcher")

    async def stop(self) -> None:
        """Answer what is queued and the batch in flight, then stop the worker."""
        self._stopping = True
        if self._queue is not None and self._task is not None:
            while (not self._queue.empty() or self._busy) and not self._task.done():
                await asyncio.sleep(0.01)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await asyncio.to_thread(self._executor.shutdown, wait=True)

    def free_slots(self) -> int:
        return self.queue_size - self.depth

    async def submit_many(self, questions: list[MCQuestion]) -> list[asyncio.Future]:
        """Queue all questions or none (QueueFullError). Returns one future per question."""
        if self._queue is None:
            raise RuntimeError("the batcher is not started")
        if len(questions) > self.free_slots():
            raise QueueFullError(f"{self.depth} questions are waiting; the queue holds {self.queue_size}")
        loop = asyncio.get_running_loop()
        futures = []
        for q in questions:
            fut = loop.create_future()
            self._queue.put_nowait(_Item(q, fut))
            futures.append(fut)
        self.on_depth(self.depth)
        return futures

    async def _gather(self) -> list[_Item]:
        assert self._queue is not None
        batch = [await self._queue.get()]
        self._busy = True  # from the first question taken: stop() must wait for it
        deadline = time.monotonic() + self.max_wait
        while len(batch) < self.max_batch_size:
            try:
                batch.append(self._queue.get_nowait())
                continue
            except asyncio.QueueEmpty:
                pass
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self._queue.get(), remaining))
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

    async def _answer(self, batch: list[_Item]) -> None:
        loop = asyncio.get_running_loop()
        self.on_depth(self.depth)
        live = [item for item in batch if not item.future.done()]  # timed-out requests are skipped
        if not live:
            return
        start = time.perf_counter()
        try:
            results = await loop.run_in_executor(self._executor, self.predict, [i.question for i in live])
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
        self.on_batch(len(live), time.perf_counter() - start)
        for item, result in zip(live, results):
            if not item.future.done():
                item.future.set_result(result)
