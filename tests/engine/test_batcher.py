"""MicroBatcher on its own, with a fake predict function (no model)."""

import asyncio
import threading
import time

import pytest

from ibedl.core.prompt import MCQuestion
from ibedl.engine.admission import Admission
from ibedl.engine.batcher import MicroBatcher
from ibedl.engine.capacity import ServiceTime
from ibedl.engine.errors import DeadlineExceeded, NeedsTooLong, Overloaded, QueueFull, ShuttingDown


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


def test_passes_never_mix_models_and_take_turns():
    """Requests for two adapters (two predict functions) queued together: every pass holds one model's
    questions, each question is answered by its own model, and the second model's request is not starved
    behind a long request of the first."""

    async def main():
        first, second = FakePredict(delay=0.05), FakePredict(delay=0.05)
        second.batches = first.batches  # one log of passes, in the order they ran
        b = MicroBatcher(first, max_batch_size=8, max_wait_ms=50)
        b.start()
        long = await b.submit_many([q(f"a{i}") for i in range(12)], predict=first)
        other = await b.submit_many([q(f"b{i}") for i in range(3)], predict=second)
        default = await b.submit_many([q("a-default")])  # no model named: the batcher's own
        answers = await asyncio.gather(*long, *other, *default)
        await b.stop()
        return first.batches, answers

    batches, answers = run(main())
    assert answers == [f"a{i}" for i in range(12)] + [f"b{i}" for i in range(3)] + ["a-default"]
    assert [len({t[0] for t in batch}) for batch in batches] == [1] * len(batches)  # one model per pass
    # round robin: the second model's request runs between the first's passes, not after all 13
    assert batches == [["a0", "a-default", "a1", "a2", "a3", "a4", "a5", "a6"], ["b0", "b1", "b2"],
                       ["a7", "a8", "a9", "a10", "a11"]]


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
        gate = Gate()
        b = MicroBatcher(gate, max_batch_size=2, max_wait_ms=1)
        b.start()
        futures = await b.submit_many([q(f"q{i}") for i in range(5)])
        await gate.wait_entered()  # the first batch is in the executor, held there
        stopping = asyncio.create_task(b.stop())
        for _ in range(1000):  # until stop() has begun (it refuses new work at once)
            if not b.running:
                break
            await asyncio.sleep(0.001)
        assert not b.running and not stopping.done()  # stop() waits for the pass in flight ...
        assert not any(f.done() for f in futures)
        for _ in range(3):  # ... and the two passes of the queue after it
            gate.release.release()
        await asyncio.wait_for(stopping, 10)
        return gate.batches, [f.done() and not f.cancelled() and f.result() for f in futures]

    batches, answers = run(main())
    assert answers == [f"q{i}" for i in range(5)]
    assert batches == [["q0", "q1"], ["q2", "q3"], ["q4"]]


def test_queue_full_is_all_or_nothing():
    async def main():
        b = MicroBatcher(FakePredict(delay=0.2), max_batch_size=1, max_wait_ms=1, queue_size=3)
        b.start()
        await b.submit_many([q("a"), q("b")])
        with pytest.raises(QueueFull, match="the queue holds 3"):
            await b.submit_many([q("c"), q("d")])
        depth = b.depth
        await b.stop()
        return depth

    assert run(main()) <= 2


class Gate:
    """A predict function that blocks each pass until released (so the test decides what is queued when)."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.release = threading.Semaphore(0)
        self.entered = threading.Semaphore(0)

    def __call__(self, questions):
        self.entered.release()
        assert self.release.acquire(timeout=10), "the test never released the pass"
        texts = [x.question for x in questions]
        self.batches.append(texts)
        return texts

    async def wait_entered(self):
        assert await asyncio.to_thread(self.entered.acquire, True, 10), "no pass started"


def test_requests_take_turns_so_a_small_one_is_not_stuck_behind_a_large_one():
    async def main():
        gate = Gate()
        b = MicroBatcher(gate, max_batch_size=2, max_wait_ms=0)
        b.start()
        first = await b.submit_many([q("first")])
        await gate.wait_entered()  # the first pass holds the model
        big = await b.submit_many([q(f"big{i}") for i in range(5)])
        small = await b.submit_many([q("small")])
        for _ in range(4):
            gate.release.release()
        results = await asyncio.gather(*first, *big, *small)
        await b.stop()
        return gate.batches, results

    batches, results = run(main())
    assert results == ["first"] + [f"big{i}" for i in range(5)] + ["small"]  # each request in its own order
    assert batches == [["first"], ["big0", "small"], ["big1", "big2"], ["big3", "big4"]]


def test_a_small_request_behind_a_large_one_rides_the_next_pass_alone():
    async def main():
        gate = Gate()
        b = MicroBatcher(gate, max_batch_size=8, max_wait_ms=0, max_batch_tokens=4000)
        b.start()
        big = await b.submit_many([q(f"long{i}") for i in range(8)], [950] * 8)
        await gate.wait_entered()  # the first pass (4 long questions) holds the model
        small = await b.submit_many([q("short")], [150])
        for _ in range(3):
            gate.release.release()
        results = await asyncio.gather(*big, *small)
        await b.stop()
        return gate.batches, results

    batches, results = run(main())
    assert results == [f"long{i}" for i in range(8)] + ["short"]
    assert batches == [[f"long{i}" for i in range(4)], ["short"], [f"long{i}" for i in range(4, 8)]]


def test_a_request_near_its_deadline_goes_before_shorter_ones():
    async def main():
        gate = Gate()
        b = MicroBatcher(gate, max_batch_size=1, max_wait_ms=0, service_time=ServiceTime(0.01), max_batch_tokens=100)
        b.start()
        running = await b.submit_many([q("running")], [10])
        await gate.wait_entered()
        short = await b.submit_many([q("short")], [5])
        relaxed = await b.submit_many([q("relaxed")], [50], time.monotonic() + 60)  # 0.5 s of work, 60 s left
        urgent = await b.submit_many([q("urgent")], [50], time.monotonic() + 1.2)  # 0.5 s of work, 1.2 s left
        for _ in range(4):
            gate.release.release()
        await asyncio.gather(*running, *short, *relaxed, *urgent)
        await b.stop()
        return gate.batches

    # urgent's slack (1.2 s - 0.5 s of work) is under one pass (100 tokens = 1 s): it goes first; then the
    # shortest question; relaxed (60 s of slack) waits its turn
    assert run(main()) == [["running"], ["urgent"], ["short"], ["relaxed"]]


def test_a_pass_holds_at_most_max_batch_tokens():
    async def main():
        predict = FakePredict()
        b = MicroBatcher(predict, max_batch_size=8, max_wait_ms=50, max_batch_tokens=10)
        futures = []
        b.start()
        for name, tokens in (("a", 6), ("b", 6), ("c", 3), ("d", 12)):
            futures += await b.submit_many([q(name)], [tokens])
        await asyncio.gather(*futures)
        await b.stop()
        return predict.batches

    # a first, with what is of a similar length and fits beside it (c: 6 + 3 <= 10; b would make 12); d (12) is
    # more than twice b's length, and alone exceeds the bound: it still runs, alone
    assert run(main()) == [["a", "c"], ["b"], ["d"]]


def test_admission_refuses_what_cannot_meet_its_deadline():
    async def main():
        gate = Gate()
        b = MicroBatcher(gate, max_batch_size=1, max_wait_ms=0, service_time=ServiceTime(0.1),
                         admission=Admission(margin=1.0))
        b.start()
        now = time.monotonic()
        with pytest.raises(NeedsTooLong, match="about 2.0 s of model time"):
            await b.submit_many([q("huge")], [20], now + 1.5)  # 20 tokens x 0.1 s alone exceed 1.5 s
        running = await b.submit_many([q("a")], [5], now + 100)
        await gate.wait_entered()
        queued = await b.submit_many([q("b"), q("c")], [5, 5], now + 100)
        # a new 1-question request of 4 tokens waits one turn of the queued request (5) and its own 4 tokens:
        # 0.9 s, plus at most 0.5 s left of the pass in flight
        wait = b.expected_wait([4])
        assert 0.9 <= wait <= 1.4 + 1e-9
        with pytest.raises(Overloaded) as refused:
            await b.submit_many([q("d")], [4], time.monotonic() + 0.7)
        assert 0.2 - 1e-3 <= refused.value.wait_s <= 0.7 + 1e-3  # = expected wait - 0.7 s left
        assert refused.value.retry_after == 1 and refused.value.reason == "capacity"  # whole seconds, at least 1
        admitted = await b.submit_many([q("e")], [4], time.monotonic() + 5)
        for _ in range(4):
            gate.release.release()
        results = await asyncio.gather(*running, *queued, *admitted)
        await b.stop()
        return results, gate.batches

    results, batches = run(main())
    assert results == ["a", "b", "c", "e"]
    # e has the least slack (the default max_batch_tokens makes one pass long: all are at risk)
    assert batches == [["a"], ["e"], ["b"], ["c"]]


def test_abandoned_and_expired_questions_never_reach_the_model():
    async def main():
        gate = Gate()
        b = MicroBatcher(gate, max_batch_size=4, max_wait_ms=0)  # no estimate yet: everything is admitted
        b.start()
        running = await b.submit_many([q("running")])
        await gate.wait_entered()
        gone = await b.submit_many([q("gone1"), q("gone2")])
        expiring = await b.submit_many([q("expiring")], deadline=time.monotonic() + 0.05)
        kept = await b.submit_many([q("kept")])
        for f in gone:
            f.cancel()  # the client went away
        await asyncio.sleep(0.1)  # the deadline passes while the question waits
        gate.release.release()
        gate.release.release()
        results = await asyncio.gather(*running, *kept)
        error = await asyncio.gather(*expiring, return_exceptions=True)
        await b.stop()
        return gate.batches, results, error

    batches, results, error = run(main())
    assert results == ["running", "kept"]
    assert batches == [["running"], ["kept"]]
    assert isinstance(error[0], DeadlineExceeded)


def test_a_queued_request_that_can_no_longer_finish_in_time_is_refused_before_its_pass():
    async def main():
        gate = Gate()
        st = ServiceTime(0.01)
        b = MicroBatcher(gate, max_batch_size=1, max_wait_ms=0, service_time=st)
        b.start()
        running = await b.submit_many([q("running")], [10])
        await gate.wait_entered()
        soon = await b.submit_many([q("soon")], [10], time.monotonic() + 2.0)  # admitted: 0.2 s expected
        st.per_token_s = 1.0  # the machine slowed down: "soon" now needs 10 s
        gate.release.release()
        answered = await asyncio.gather(*running)
        refused = await asyncio.gather(*soon, return_exceptions=True)
        await b.stop()
        return answered, refused, gate.batches

    answered, refused, batches = run(main())
    assert answered == ["running"] and batches == [["running"]]
    assert isinstance(refused[0], Overloaded)


def test_a_pass_is_not_made_longer_than_the_deadlines_in_it_allow():
    async def main():
        predict = FakePredict()
        b = MicroBatcher(predict, max_batch_size=4, max_wait_ms=50, service_time=ServiceTime(0.01))
        b.start()
        now = time.monotonic()
        # each alone takes 0.5 s; together 1 s, past "tight"'s deadline: they run in two passes
        tight = await b.submit_many([q("tight")], [50], now + 0.8)
        ok = await b.submit_many([q("ok")], [50], now + 5.0)
        results = await asyncio.gather(*tight, *ok)
        await b.stop()
        return predict.batches, results

    batches, results = run(main())
    assert batches == [["tight"], ["ok"]] and results == ["tight", "ok"]


def test_a_question_whose_pass_would_end_after_its_deadline_gets_overloaded_not_a_late_answer():
    async def main():
        predict = FakePredict()
        st = ServiceTime(0.01)
        b = MicroBatcher(predict, max_batch_size=4, max_wait_ms=0, service_time=st)
        b.start()
        late = await b.submit_many([q("late")], [50], time.monotonic() + 0.8)  # admitted: 0.5 s expected
        st.per_token_s = 0.02  # the machine slowed down before its pass: 1 s now
        results = await asyncio.gather(*late, return_exceptions=True)
        await b.stop()
        return predict.batches, results

    batches, results = run(main())
    assert batches == [] and isinstance(results[0], Overloaded)


def test_requests_that_took_longer_than_estimated_make_admission_stricter():
    """The overrun (how much longer than estimated requests took) multiplies the wait of a request behind others;
    one with nothing ahead of it that fits alone is admitted whatever it says (a lone client is never refused)."""
    async def main():
        gate = Gate()
        b = MicroBatcher(gate, max_batch_size=1, max_wait_ms=0, service_time=ServiceTime(0.01),
                         admission=Admission(margin=1.0))
        b.start()
        assert b.overrun == 1.0
        b._observe_wait(3.0)  # a request took 3x its estimate
        raised = b.overrun
        for _ in range(20):
            b._observe_wait(1.0)  # then on time again
        recovered = b.overrun
        b._observe_wait(3.0)
        lone = await b.submit_many([q("lone")], [50], time.monotonic() + 0.8)  # 0.5 s alone fits in 0.8 s
        await gate.wait_entered()  # its pass holds the model: the next request waits behind it
        with pytest.raises(Overloaded):  # 0.5 s left of the pass + 0.5 s own, x overrun 2 > 0.8 s left
            await b.submit_many([q("behind")], [50], time.monotonic() + 0.8)
        gate.release.release()
        await asyncio.gather(*lone)
        await b.stop()
        return raised, recovered, gate.batches

    raised, recovered, batches = run(main())
    assert raised == pytest.approx(2.0)  # half way at once
    assert 1.0 < recovered < 1.5  # and back slowly
    assert batches == [["lone"]]


def test_drain_answers_what_fits_in_the_grace_period_and_refuses_the_rest():
    async def main():
        gate = Gate()
        b = MicroBatcher(gate, max_batch_size=1, max_wait_ms=0, service_time=ServiceTime(0.1))
        b.start()
        running = await b.submit_many([q("running")], [1])
        await gate.wait_entered()
        fits = await b.submit_many([q("fits")], [5])  # 0.5 s of work
        late = await b.submit_many([q("late")], [200])  # 20 s of work: cannot finish in a 3 s grace period
        b.begin_drain(3.0)
        with pytest.raises(ShuttingDown):
            await b.submit_many([q("after")], [1])
        # a request that arrived before the drain but reaches the batcher after it: queued if it fits
        with pytest.raises(ShuttingDown):
            await b.submit_many([q("admitted-late")], [200], admitted_before_drain=True)
        fits += await b.submit_many([q("admitted")], [1], admitted_before_drain=True)
        for _ in range(3):
            gate.release.release()
        answered = await asyncio.gather(*running, *fits)
        refused = await asyncio.gather(*late, return_exceptions=True)
        await b.stop()
        return answered, refused, gate.batches

    answered, refused, batches = run(main())
    assert answered == ["running", "fits", "admitted"]
    assert batches == [["running"], ["fits"], ["admitted"]]
    assert isinstance(refused[0], ShuttingDown)


def test_grace_period_end_refuses_whatever_is_still_queued():
    async def main():
        gate = Gate()
        b = MicroBatcher(gate, max_batch_size=1, max_wait_ms=0)  # no estimate: the drain cannot foresee
        b.start()
        running = await b.submit_many([q("running")])
        await gate.wait_entered()
        queued = await b.submit_many([q("queued")])
        b.begin_drain(0.2)
        outcome = await asyncio.gather(*queued, return_exceptions=True)  # refused at the end of the grace period
        gate.release.release()
        answered = await asyncio.gather(*running)
        await b.stop()
        return answered, outcome

    answered, outcome = run(main())
    assert answered == ["running"] and isinstance(outcome[0], ShuttingDown)


@pytest.mark.parametrize("kwargs, message", [({"max_batch_size": 0}, "max_batch_size"),
                                             ({"queue_size": 0}, "queue_size"),
                                             ({"max_batch_tokens": 0}, "max_batch_tokens")])
def test_bad_settings_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MicroBatcher(FakePredict(), **kwargs)


def test_a_given_executor_runs_every_pass_and_between_passes_and_outlives_the_batcher():
    """The engine gives the thread it loaded the model on (one OpenMP team, ibedl.engine.engine.Engine): passes and
    background work run there, and the engine, not the batcher, shuts it down."""
    from concurrent.futures import ThreadPoolExecutor

    model = ThreadPoolExecutor(1, thread_name_prefix="model")
    model_thread = model.submit(threading.get_ident).result()
    seen: list[int] = []

    def predict(questions):
        seen.append(threading.get_ident())
        return [x.question for x in questions]

    async def main():
        b = MicroBatcher(predict, max_batch_size=2, max_wait_ms=1, executor=model)
        b.start()
        answers = await asyncio.gather(*await b.submit_many([q(f"q{i}") for i in range(3)]))
        background = await b.between_passes(threading.get_ident)
        await b.stop()
        return answers, background

    try:
        answers, background = run(main())
        assert answers == ["q0", "q1", "q2"]
        assert len(seen) == 2 and set(seen) == {model_thread} and background == model_thread
        assert model.submit(lambda: "still open").result() == "still open"  # the batcher left it to its owner
    finally:
        model.shutdown()


@pytest.mark.parametrize("similar, expected", [(2.0, [["a", "c"], ["b"], ["d"]]),
                                               (float("inf"), [["a", "b", "c", "d"]])])
def test_similar_bounds_how_much_the_prompt_lengths_of_a_pass_may_differ(similar, expected):
    """By default a pass takes questions within a factor 2 of its first one's length (c: 5 beside a's 4; b, 40, and d,
    400, wait for passes of their own); ``similar=inf`` (the engine's IBEDL_PAD_FREELY) takes them whatever their
    lengths."""

    async def main():
        predict = FakePredict()
        b = MicroBatcher(predict, max_batch_size=8, max_wait_ms=50, similar=similar)
        b.start()
        futures = []
        for name, tokens in (("a", 4), ("b", 40), ("c", 5), ("d", 400)):
            futures += await b.submit_many([q(name)], [tokens])
        await asyncio.gather(*futures)
        await b.stop()
        return predict.batches

    assert run(main()) == expected


def test_similar_below_one_is_refused():
    with pytest.raises(ValueError, match="similar must be >= 1, got 0.5"):
        MicroBatcher(FakePredict(), similar=0.5)


def test_without_the_similarity_rule_a_pass_keeps_its_padded_tokens_within_max_batch_tokens():
    """Padded to its longest prompt, a pass of one 100-token question and 20-token ones costs 100 tokens a question:
    at most 4 fit in 400 padded tokens (their real 160 would admit all 8); the rest wait for passes of their own."""

    async def main():
        predict = FakePredict()
        b = MicroBatcher(predict, max_batch_size=8, max_wait_ms=50, max_batch_tokens=400, similar=float("inf"))
        b.start()
        futures = await b.submit_many([q("long")], [100])
        for i in range(7):
            futures += await b.submit_many([q(f"s{i}")], [20])
        await asyncio.gather(*futures)
        await b.stop()
        return predict.batches

    assert run(main()) == [["long", "s0", "s1", "s2"], ["s3", "s4", "s5", "s6"]]
