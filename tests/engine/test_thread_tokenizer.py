"""ibedl.engine.thread_tokenizer: each thread tokenises prompts on its own tokenizer copy, never on one another
thread is using (a Hugging Face fast tokenizer is not safe to share between threads)."""

import threading

import pytest

from ibedl.core.predictor import Predictor, prompt_ids
from ibedl.core.prompt import MCQuestion
from ibedl.engine.requests import tokenized
from ibedl.engine.runtime import make_runtimes
from ibedl.engine.settings import EngineSettings
from ibedl.engine.thread_tokenizer import PerThreadTokenizer

THREADS = 8
ROUNDS = 200


def test_threads_tokenise_concurrently_on_their_own_copies_as_one_thread_does(tiny_artifact):
    (predictor,) = Predictor.from_artifacts([tiny_artifact])
    runtime = next(iter(make_runtimes([predictor], EngineSettings(artifact=tiny_artifact, max_tokens=96)).values()))
    questions = [MCQuestion(f"Question {i}: which is {'very ' * i}wet?", ("water", "sand", "dust")[: 2 + i % 2],
                            context=f"Water is wet. {'Sand is dry. ' * i}" if i % 3 else None)
                 for i in range(THREADS)]
    expected = [tuple(prompt_ids(predictor.tokenizer, predictor.template, q)) for q in questions]
    # every thread's prompts differ from the others' at each round
    assert len({len(ids) for ids in expected}) == THREADS
    start = threading.Barrier(THREADS)
    counts: list[list[int]] = [[] for _ in range(THREADS)]
    used: list[object] = [None] * THREADS
    errors: list[BaseException] = []

    def count(t: int) -> None:
        try:
            start.wait(timeout=60)  # all threads tokenize at once
            for r in range(ROUNDS):
                counts[t].append(tokenized(runtime, [questions[(t + r) % THREADS]])[0].prompt_ids)
            used[t] = runtime.count_tokenizers.get()
        except BaseException as e:  # a thread's failure is the test's
            errors.append(e)
            start.abort()

    threads = [threading.Thread(target=count, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == [] and not any(thread.is_alive() for thread in threads)
    for t in range(THREADS):
        assert counts[t] == [expected[(t + r) % THREADS] for r in range(ROUNDS)], t
    assert len({id(tokenizer) for tokenizer in used}) == THREADS  # one copy per thread
    assert all(tokenizer is not predictor.tokenizer for tokenizer in used)  # the model's own is never handed out
    assert runtime.count_tokenizers.get() is runtime.count_tokenizers.get()  # a thread keeps its copy
    assert runtime.count_tokenizers.source is predictor.tokenizer  # what the copies equal


def test_it_takes_a_tokenizer():
    with pytest.raises(ValueError, match="tokenizer must be a callable tokenizer, got NoneType"):
        PerThreadTokenizer(None)
