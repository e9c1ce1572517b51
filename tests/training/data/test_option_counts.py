"""Questions asked with another number of options: the right answer kept, own distractors first, borrowed wrong
options distinct, letters shuffled, seeded."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from ibedl.core.prompt import MCQuestion
from ibedl.training.data.option_counts import parse_counts, vary_option_counts, with_options

QUESTIONS = [MCQuestion(f"q{i}?", (f"right{i}", f"w{i}a", f"w{i}b", f"w{i}c"), answer=0, id=f"id{i}")
             for i in range(40)]


def test_parse_counts():
    assert parse_counts("6,2, 4,2") == (2, 4, 6)
    with pytest.raises(ValueError, match="must be in 2..26, got 1"):
        parse_counts("1,4")
    with pytest.raises(ValueError, match="integers separated by commas, got 'x'"):
        parse_counts("4,x")


@pytest.mark.parametrize("count", [2, 3, 4, 5, 6, 9])
def test_the_answer_stays_and_own_distractors_come_first(count):
    rng = random.Random(0)
    pool = [o for q in QUESTIONS for o in q.options]
    q = QUESTIONS[3]
    v = with_options(q, count, pool, rng)
    assert len(v.options) == count and v.options[v.answer] == q.options[q.answer]
    own = set(q.options) - {q.options[q.answer]}
    wrong = [o for i, o in enumerate(v.options) if i != v.answer]
    assert len({o.lower() for o in v.options}) == count  # all distinct
    assert (set(wrong) <= own) if count <= 4 else (own <= set(wrong))  # own distractors before borrowed ones
    assert v.meta["options_from"] == 4 and v.question == q.question and v.context == q.context


def test_a_question_without_an_answer_or_a_short_pool_is_refused():
    rng = random.Random(0)
    with pytest.raises(ValueError, match="has no answer"):
        with_options(MCQuestion("q?", ("a", "b")), 3, ["c"], rng)
    with pytest.raises(ValueError, match="not enough distinct wrong options"):
        with_options(MCQuestion("q?", ("a", "b"), answer=0), 4, ["b", "B", "a"], rng)


def test_a_sample_keeps_its_own_count_whole_and_varies_a_seeded_subset_for_the_others():
    out = vary_option_counts(QUESTIONS, (2, 4, 6), per_count=10, seed=1)
    by = Counter(len(q.options) for q in out)
    assert by == {2: 10, 4: 40, 6: 10}
    assert [q for q in out if len(q.options) == 4] == QUESTIONS  # unchanged, in order
    assert all(q.id.endswith("@6") for q in out if len(q.options) == 6)
    assert out == vary_option_counts(QUESTIONS, (6, 2, 4), per_count=10, seed=1)  # seeded, count order
    assert out != vary_option_counts(QUESTIONS, (2, 4, 6), per_count=10, seed=2)
    # the right answer's letter is spread over the positions
    letters = Counter(q.answer for q in vary_option_counts(QUESTIONS, (6,), seed=0))
    assert len(letters) >= 5
