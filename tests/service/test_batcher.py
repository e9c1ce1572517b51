"""MicroBatcher on its own, with a fake predict function (no model)."""

import asyncio
import threading
import time

import pytest

from evidential.prompt import MCQuestion
from service.batcher import MicroBatcher, QueueFullError


def q(text: str) -> MCQuestion:
    return MCQuestion(text, ("a", "b"))


class FakePredict:
    """Answers each question with its text; fails any batch holding a question "poison"."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.batches: list[list[str]] = []
        self.lock = threading.Lock()

    def __call__(self, questions):
        time.sleep(self.delay)
        texts = [x.question for x in questions]
        with self.lock:
            self.batches.append(texts)
        if "poison" in texts:
            raise RuntimeError("cannot answer poison")
        return texts


def run(coro):
    return asyncio.run(coro)


def test_concurrent_questions_share_a_batch():
    async def main():
        predict = FakePredict(delay=0.05)
        b = MicroBatcher(predict, max_batch_size=8, max_wait_ms=50)
        b.start()
        futures = await b.submit_many([q(f"q{i}") for i in range(5)])
        answers = await asyncio.gather(*futures)
        await b.stop()
        return predict.batches, answers

    batches, answers = run(main())
    assert answers == [f"q{i}" for i in range(5)]
    assert batches == [[f"q{i}" for i in range(5)]]


def test_one_failing_question_does_not_fail_its_batch_mates():
    async def main():
        predict = FakePredict()
        b = MicroBatcher(predict, max_batch_size=8, max_wait_ms=50)
        b.start()
        futures = await b.submit_many([q("q0"), q("poison"), q("q2")])
        results = await asyncio.gather(*futures, return_exceptions=True)
        await b.stop()
        return predict.batches, results

    batches, results = run(main())
    assert results[0] == "q0" and results[2] == "q2"
    assert isinstance(results[1], RuntimeError) and "poison" in str(results[1])
    assert batches[0] == ["q0", "poison", "q2"]  # tried together first, then one by one
    assert sorted(map(tuple, batches[1:])) == [("poison",), ("q0",), ("q2",)]


def test_stop_answers_the_batch_in_flight_and_the_queue():
    async def main():
        predict = FakePredict(delay=0.2)
        b = MicroBatcher(predict, max_batch_size=2, max_wait_ms=1)
        b.start()
        futures = await b.submit_many([q(f"q{i}") for i in range(5)])
        await asyncio.sleep(0.05)  # the first batch is now in the executor
        await b.stop()
        return [f.done() and not f.cancelled() and f.result() for f in futures]

    assert run(main()) == [f"q{i}" for i in range(5)]


def test_queue_full_is_all_or_nothing():
    async def main():
        b = MicroBatcher(FakePredict(delay=0.2), max_batch_size=1, max_wait_ms=1, queue_size=3)
        b.start()
        await b.submit_many([q("a"), q("b")])
        with pytest.raises(QueueFullError, match="the queue holds 3"):
            await b.submit_many([q("c"), q("d")])
        depth = b.depth
        await b.stop()
        return depth

    assert run(main()) <= 2


@pytest.mark.parametrize("kwargs, message", [({"max_batch_size": 0}, "max_batch_size"), ({"queue_size": 0}, "queue_size")])
def test_bad_settings_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MicroBatcher(FakePredict(), **kwargs)
