"""The engine object: its scheduler serves callers on any thread (the Python API's door) with fair turns and the
same admission as HTTP clients; answers, feedback and guarantees come from it alone."""

import asyncio
import sqlite3
import threading
import time

import pytest

from ibedl.engine.engine import Engine
from ibedl.engine.errors import NotReady, Overloaded, QueueFull, Timeout
from ibedl.engine.settings import EngineSettings
from tests.conftest import thread_recording_loader, tokenizer_calls
from tests.engine.conftest import engine_with

Q = {"question": "Which is sun?", "options": ["sun", "moon", "tree"]}


def wait_until(condition, seconds: float = 30.0) -> None:
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.01)


def test_threads_take_fair_turns_in_one_scheduler(tiny_artifact):
    """A thread that sends one question while another's six-question request waits is answered in the next pass,
    not after all six: the notebook's threads are scheduled as the service's clients are."""
    gate = threading.Event()
    engine, passes = engine_with(tiny_artifact, gate=gate, max_batch_size=2)
    try:
        big = [{**Q, "question": f"big {i}"} for i in range(6)]
        done: dict[str, object] = {}
        first = threading.Thread(target=lambda: done.setdefault("big", engine.predict(big, batch_size=6)))
        first.start()
        wait_until(lambda: passes)  # the big request's first pass holds the model (2 questions), 4 wait
        second = threading.Thread(target=lambda: done.setdefault("small", engine.predict([{**Q, "question": "small"}])))
        second.start()
        wait_until(lambda: engine.batcher.depth == 5)  # the small question waits too
        gate.set()
        first.join()
        second.join()
        assert len(done["big"]) == 6 and len(done["small"]) == 1
        small_pass = next(i for i, p in enumerate(passes) if "small" in p)
        assert small_pass == 1, passes  # the pass right after the one in flight, before big's remaining ones
        assert sum(len(p) for p in passes) == 7 and max(len(p) for p in passes) <= 2
    finally:
        engine.close()


def test_the_python_door_is_admitted_like_http(tiny_artifact):
    engine, _ = engine_with(tiny_artifact, queue_size=2)
    try:
        with pytest.raises(QueueFull, match="the queue holds 2") as e:
            engine.predict([Q, Q, Q], batch_size=3)
        assert e.value.reason == "queue_full" and e.value.retry_after == 1
        assert len(engine.predict([Q, Q, Q], batch_size=2)) == 3  # in requests the queue holds
    finally:
        engine.close()


def test_a_deadline_is_kept(tiny_artifact):
    gate = threading.Event()
    engine, passes = engine_with(tiny_artifact, gate=gate)
    try:
        blocker = threading.Thread(target=lambda: engine.predict([Q]))
        blocker.start()
        wait_until(lambda: passes)  # the model is held: the next request cannot be answered in time
        with pytest.raises((Timeout, Overloaded)):  # never answered after its deadline: timed out, or refused/shed
            engine.predict([Q], timeout_s=0.2)  # when the speed estimate already says it cannot make it
        gate.set()
        blocker.join()
    finally:
        gate.set()
        engine.close()


def test_close_stops_the_engines_own_thread(tiny_artifact):
    engine, _ = engine_with(tiny_artifact)
    assert len(engine.predict([Q])) == 1
    thread = engine._thread
    assert thread is not None and thread.is_alive()
    engine.close()
    assert not thread.is_alive() and engine._thread is None
    engine.close()  # twice: a no-op


@pytest.mark.parametrize("answered", [False, True], ids=["never-answered", "answered"])
def test_close_releases_the_model_thread_and_the_feedback_store(tiny_artifact, tmp_path, answered):
    """Closed before its first question, or after answering without ever recording a label, an engine leaves no
    model thread running and no feedback store open (both were left before: close() returned early, and the store
    was closed only through a thread a label had started)."""
    engine = Engine.load(EngineSettings(artifact=tiny_artifact, max_tokens=96, feedback_key="k" * 16,
                                        feedback_db=tmp_path / "feedback.db"))
    if answered:
        assert len(engine.predict([Q])) == 1
    threads, db = set(engine._model._threads), engine.feedback.store._db
    assert threads and all(t.is_alive() for t in threads) and db.execute("SELECT 1").fetchone() == (1,)
    engine.close()
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(sqlite3.ProgrammingError, match="closed"):
        db.execute("SELECT 1")
    assert engine.health() == ("stopped", "the engine is closed")
    with pytest.raises(NotReady, match="stopped"):
        engine.predict([Q])
    engine.close()  # twice: a no-op


def test_a_load_waiting_for_the_store_gives_up_once_the_engine_stopped():
    """stop() while open() waits for the feedback store closes the store: the wait ends at its next try instead of
    retrying a closed store for ever, and the stopped engine's reason is left alone."""
    import types

    bound = []
    feedback = types.SimpleNamespace(enabled=True, shared=True, store=None, bind=bound.append)
    engine = Engine(EngineSettings(), loader=lambda s: None, feedback=feedback)

    async def main():
        await engine.stop()
        reason = engine.reason
        await asyncio.wait_for(engine._bind_feedback({}), 5.0)
        assert engine.status == "stopped" and engine.reason == reason and not bound

    asyncio.run(main())


def test_close_leaves_an_engine_a_door_runs_to_the_door(tiny_artifact):
    """The HTTP door opens the engine on its own loop and stops it itself: close() from another thread changes
    nothing, the model thread and the scheduler go on answering."""
    engine = Engine(EngineSettings(artifact=tiny_artifact, max_tokens=96))

    async def door():
        await engine.open()
        await asyncio.to_thread(engine.close)
        assert engine.status == "ready" and all(t.is_alive() for t in engine._model._threads)
        assert len(await asyncio.to_thread(engine.predict, [Q])) == 1
        await engine.stop()

    asyncio.run(door())
    assert engine.status == "stopped"


def test_answers_from_the_engine_equal_the_python_api(tiny_artifact):
    import ibedl

    engine, _ = engine_with(tiny_artifact)
    with ibedl.load(tiny_artifact, max_tokens=96) as model:
        try:
            assert [a.model_dump() for a in engine.predict([Q])] == [a.model_dump() for a in model.predict([Q])]
            assert model.engine.cards() == engine.cards()
        finally:
            engine.close()


def test_the_model_loads_warms_and_answers_on_one_thread(tiny_artifact):
    """torch's OpenMP keeps a team of workers per thread that ran it; two teams on the cores make every parallel
    region sleep and wake its workers (1.4-1.9x the time a question took). So the Python door loads, warms and
    answers on the engine's one model thread, neither the caller's nor the scheduler's."""
    threads: list[tuple[str, int]] = []
    engine = Engine.load(EngineSettings(artifact=tiny_artifact, max_tokens=96), loader=thread_recording_loader(threads))
    try:
        engine.predict([Q])
        engine.predict([Q, {**Q, "question": "Which is moon?"}], batch_size=2)
        scheduler = engine._thread.ident
    finally:
        engine.close()
    kinds = [k for k, _ in threads]
    assert kinds[0] == "load" and kinds.count("predict") >= 4, kinds  # warm-up twice, then the passes
    assert len({t for _, t in threads}) == 1, threads
    assert threads[0][1] not in (threading.get_ident(), scheduler)


def test_pad_freely_answers_a_pass_of_mixed_lengths_in_one_forward_with_the_same_answers(tiny_artifact):
    """IBEDL_PAD_FREELY (for a GPU): questions of very different prompt lengths share one pass, run as one padded
    forward, and get the answers they get in the passes and length groups of the default rules (right padding, read
    at the last real token)."""
    bodies = [{**Q, "question": "short"}, {**Q, "question": "long", "context": "w " * 30},
              {**Q, "question": "mid", "context": "w " * 8}]
    runs = {}
    for free in (False, True):
        engine, passes = engine_with(tiny_artifact, pad_freely=free, max_batch_size=8)
        predictor, forwards = engine.default.predictor, []
        forward = predictor.forward
        predictor.forward = lambda batch, forward=forward, forwards=forwards: (
            forwards.append(tuple(batch.input_ids.shape)) or forward(batch))
        try:
            runs[free] = passes, forwards, engine.predict(bodies, batch_size=3)
        finally:
            engine.close()
    (strict_passes, strict_forwards, strict), (free_passes, free_forwards, free) = runs[False], runs[True]
    assert len(strict_passes) == 3 and len(strict_forwards) == 3, (strict_passes, strict_forwards)
    assert free_passes == [["short", "long", "mid"]] and len(free_forwards) == 1 and free_forwards[0][0] == 3
    for a, b in zip(strict, free, strict=True):
        assert a.probabilities == pytest.approx(b.probabilities, abs=1e-5)
        assert a.uncertainty_mass == pytest.approx(b.uncertainty_mass, abs=1e-5)
        assert a.prediction == b.prediction and a.abstained == b.abstained


def test_a_checked_prompt_is_tokenised_once_off_the_model_thread(tiny_artifact, monkeypatch):
    """The check tokenises each prompt to count it (on the caller's thread in the Python door, on a check thread in
    the service's); the pass takes those ids: the model's thread tokenises none of a request's prompts, and the
    answers are those of the predictor tokenising them itself."""
    from ibedl.core.predictor import TokenizedQuestion
    from ibedl.core.prompt import MCQuestion

    engine, _ = engine_with(tiny_artifact)
    bodies = [Q, {**Q, "question": "Which is moon?", "context": "The moon is not the sun. " * 3}]
    predictor, passed = engine.default.predictor, []
    predict = predictor.predict
    predictor.predict = lambda questions, truncate_context=True: (passed.extend(questions)
                                                                  or predict(questions, truncate_context))
    calls = tokenizer_calls(monkeypatch, predictor.tokenizer, lambda text, called: threading.current_thread().name)
    try:
        answers = engine.predict(bodies, batch_size=2)
    finally:
        engine.close()
    assert len(passed) == 2 and all(isinstance(q, TokenizedQuestion) and predictor._tokenized_ids(q) is not None
                                    for q in passed)
    assert calls and not [name for name in calls if name.startswith("ibedl-model")], calls
    monkeypatch.undo()
    plain = predict([MCQuestion(b["question"], tuple(b["options"]), b.get("context")) for b in bodies], False)
    for answer, own in zip(answers, plain, strict=True):
        assert list(answer.probabilities.values()) == pytest.approx(own.probs, abs=1e-6)


@pytest.mark.parametrize("threads", [1, 3])
def test_requests_are_checked_on_as_many_threads_as_set_each_with_its_own_tokenizer(tiny_artifact, monkeypatch,
                                                                                    threads):
    """IBEDL_CHECK_THREADS requests are checked at once and no more: with every check held, ``threads`` are in flight
    and the others wait for a thread; each thread tokenises on a tokenizer copy of its own, never the model's; the
    answers are those of the Python door."""
    engine, _ = engine_with(tiny_artifact, check_threads=threads)
    release, lock, in_flight = threading.Event(), threading.Lock(), []
    check = engine.check

    def held(question, prefix=""):
        with lock:
            in_flight.append(threading.current_thread().name)
        assert release.wait(30), "the test never released the checks"
        return check(question, prefix)

    engine.check = held
    predictor = engine.default.predictor
    calls = tokenizer_calls(monkeypatch, predictor.tokenizer, lambda text, called: (threading.current_thread().name,
                                                                                   called))
    questions = [{**Q, "question": f"Which is sun, {i}?"} for i in range(2 * threads)]

    async def ask_all():
        from ibedl.engine.schemas import PredictRequest

        return await asyncio.gather(*(engine.ask_one(PredictRequest(**q), engine.arrive()) for q in questions))

    answers: list = []
    asking = threading.Thread(target=lambda: answers.extend(engine.call(ask_all)))
    try:
        asking.start()
        # every request handed to the pool: ``threads`` checks running, the others queued for a thread
        wait_until(lambda: engine._checker is not None and len(in_flight) == threads
                   and engine._checker._work_queue.qsize() == len(questions) - threads)
        assert len(in_flight) == threads and len(set(in_flight)) == threads
        release.set()
        asking.join(60)
        assert not asking.is_alive() and len(answers) == len(questions)
        checked = [(name, called) for name, called in calls if name.startswith("ibedl-check")]
        engine.check = check
        monkeypatch.undo()
        alone = engine.predict(questions)
    finally:
        release.set()
        engine.close()
    copies = {name: {id(called) for n, called in checked if n == name} for name, _ in checked}
    assert set(copies) == set(in_flight) and all(len(ids) == 1 for ids in copies.values())  # one copy a thread
    assert len({next(iter(ids)) for ids in copies.values()}) == threads  # each its own
    assert all(called is not predictor.tokenizer for _, called in checked)
    for a, b in zip(answers, alone, strict=True):
        assert a.probabilities == pytest.approx(b.probabilities, abs=1e-6)


def test_a_door_s_engine_is_ready_with_every_check_thread_holding_its_tokenizer_copy(tiny_artifact):
    """A copy of the tokenizer takes about 0.1 s: the engine a door opens makes each check thread's before it is
    ready, so the first requests do not wait for them one after another."""
    engine = Engine(EngineSettings(artifact=tiny_artifact, max_tokens=96, check_threads=3))
    together = threading.Barrier(3)

    def held() -> tuple[str, object]:  # one a thread: each waits until the three threads run one
        together.wait(30)
        return threading.current_thread().name, getattr(engine.default.count_tokenizers._local, "tokenizer", None)

    async def door():
        await engine.open()
        assert engine.status == "ready"
        try:
            return await asyncio.gather(*(asyncio.wrap_future(engine._checks().submit(held)) for _ in range(3)))
        finally:
            await engine.stop()

    seen = asyncio.run(door())
    assert len({name for name, _ in seen}) == 3 and all(name.startswith("ibedl-check") for name, _ in seen)
    copies = [copy for _, copy in seen]
    assert all(copy is not None for copy in copies) and len({id(c) for c in copies}) == 3
    assert all(copy is not engine.default.predictor.tokenizer for copy in copies)


@pytest.mark.parametrize("fail", [False, True])
def test_a_shutdown_during_the_check_threads_warm_up_is_never_undone_and_a_failed_warm_up_still_serves(
        tiny_artifact, monkeypatch, fail):
    """The warm-up is awaited before the engine's last look at its status: a SIGTERM's drain that lands while the
    copies are made leaves it draining, never ready. A warm-up that fails is logged and the engine serves, its
    copies made on demand."""
    from ibedl.engine import thread_tokenizer

    engine = Engine(EngineSettings(artifact=tiny_artifact, max_tokens=96, check_threads=2))
    warm = engine._warm_checks

    async def warm_then_sigterm(runtimes):
        await warm(runtimes)
        engine.drain()

    if fail:
        get = thread_tokenizer.PerThreadTokenizer.get
        calls = []
        monkeypatch.setattr(thread_tokenizer.PerThreadTokenizer, "get", lambda self: calls.append(1) or (
            get(self) if len(calls) > 2 else (_ for _ in ()).throw(RuntimeError("no copy"))))
    else:
        engine._warm_checks = warm_then_sigterm

    async def door():
        await engine.open()
        status = engine.status
        answered = len(await asyncio.to_thread(engine.predict, [Q])) if status == "ready" else 0
        await engine.stop()
        return status, answered

    status, answered = asyncio.run(door())
    assert (status, answered) == (("ready", 1) if fail else ("draining", 0))
