"""Seeded label noise and seeded subsets, directly and through load_dataset."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest

from ibedl.core.prompt import MCQuestion
from ibedl.training.data import load_dataset, perturb_labels, subset


def _questions(n: int = 200) -> list[MCQuestion]:
    # 2 to 5 options, answers spread over them
    return [
        MCQuestion(f"Q{i}?", tuple(f"o{i}.{k}" for k in range(2 + i % 4)), answer=i % (2 + i % 4), id=f"q{i}")
        for i in range(n)
    ]


@pytest.mark.parametrize(("n", "fraction"), [(200, 0.1), (200, 0.25), (201, 0.5), (7, 0.3), (200, 0.999)])
def test_exact_fraction_changed_to_valid_different_options(n: int, fraction: float) -> None:
    clean = _questions(n)
    noisy = perturb_labels(clean, fraction, seed=1)
    assert len(noisy) == n
    changed = [(c, q) for c, q in zip(clean, noisy, strict=True) if q.answer != c.answer]
    assert len(changed) == round(fraction * n)
    for c, q in changed:
        assert 0 <= q.answer < q.num_options and q.answer != c.answer
        assert q.meta["noisy_label"] is True and q.meta["clean_answer"] == c.answer
        assert (q.question, q.options, q.id) == (c.question, c.options, c.id)
    for c, q in zip(clean, noisy, strict=True):
        if q.answer == c.answer:
            assert q is c and "noisy_label" not in q.meta
    assert all("noisy_label" not in c.meta for c in clean)  # the input is not modified


def test_noise_is_deterministic_per_seed() -> None:
    clean = _questions()
    first = [q.answer for q in perturb_labels(clean, 0.3, seed=5)]
    assert first == [q.answer for q in perturb_labels(clean, 0.3, seed=5)]
    assert first != [q.answer for q in perturb_labels(clean, 0.3, seed=6)]


def test_new_label_is_uniform_over_the_other_options() -> None:
    clean = [MCQuestion(f"Q{i}?", ("a", "b", "c", "d"), answer=0) for i in range(3000)]
    counts = Counter(q.answer for q in perturb_labels(clean, 0.9, seed=0))
    assert counts[0] == 300
    for option in (1, 2, 3):
        assert 800 <= counts[option] <= 1000  # 900 expected; sd about 25


def test_zero_fraction_is_identity() -> None:
    clean = _questions()
    noisy = perturb_labels(clean, 0.0, seed=3)
    assert noisy == clean and all(a is b for a, b in zip(noisy, clean, strict=True))


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, math.nan, "0.1"])
def test_bad_fraction_raises_with_the_value(bad: object) -> None:
    with pytest.raises(ValueError, match=f"got {bad!r}"):
        perturb_labels(_questions(10), bad, seed=0)  # type: ignore[arg-type]


def test_noise_needs_answers() -> None:
    with pytest.raises(ValueError, match="'nolabel'.*no answer"):
        perturb_labels([MCQuestion("Q?", ("a", "b"), id="nolabel")], 0.5, seed=0)


def test_subset_is_seeded_stable_nested_and_in_order() -> None:
    questions = _questions(100)
    some = subset(questions, 10, seed=4)
    assert len(some) == 10 and len({q.id for q in some}) == 10
    assert some == subset(questions, 10, seed=4)
    assert some != subset(questions, 10, seed=5)
    positions = [questions.index(q) for q in some]
    assert positions == sorted(positions)  # original order kept
    assert set(map(id, some)) <= set(map(id, subset(questions, 30, seed=4)))  # a larger limit adds to it
    assert subset(questions, None, seed=4) == questions
    assert subset(questions, 500, seed=4) == questions
    assert subset(questions, 0, seed=4) == []
    with pytest.raises(ValueError, match="got -1"):
        subset(questions, -1, seed=0)


@pytest.fixture
def user_file(tmp_path: Path) -> Path:
    path = tmp_path / "user.jsonl"
    lines = [json.dumps({"question": f"Q{i}?", "options": ["a", "b", "c"], "answer": i % 3}) for i in range(50)]
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def test_load_dataset_limit_and_noise(user_file: Path) -> None:
    full = load_dataset("jsonl", "test", path=user_file)
    assert [q.id for q in full] == [f"user-{i}" for i in range(50)]  # file order without a limit
    some = load_dataset("jsonl", "test", path=user_file, limit=20, seed=1)
    again = load_dataset("jsonl", "test", path=user_file, limit=20, seed=1)
    assert [q.id for q in some] == [q.id for q in again]
    assert [q.id for q in some] == [q.id for q in subset(full, 20, seed=1)]
    assert [q.id for q in some] != [q.id for q in load_dataset("jsonl", "test", path=user_file, limit=20, seed=2)]
    # noise comes after subsetting: exactly round(0.25 * 20) = 5 of the 20 change
    noisy = load_dataset("jsonl", "test", path=user_file, limit=20, seed=1, label_noise=0.25, noise_seed=9)
    assert [q.id for q in noisy] == [q.id for q in some]
    assert sum(q.answer != c.answer for q, c in zip(noisy, some, strict=True)) == 5
    assert sum(bool(q.meta.get("noisy_label")) for q in noisy) == 5


def test_load_dataset_draws_its_subset_from_the_questions_not_excluded(user_file: Path) -> None:
    seen = {q.id for q in load_dataset("jsonl", "test", path=user_file, limit=30, seed=0)}
    fresh = load_dataset("jsonl", "test", path=user_file, limit=15, seed=0, exclude=seen)
    assert len(fresh) == 15 and not {q.id for q in fresh} & seen
    # the draw is `subset`'s over what is left, so it is seeded and stable like any other
    rest = [q for q in load_dataset("jsonl", "test", path=user_file) if q.id not in seen]
    assert [q.id for q in fresh] == [q.id for q in subset(rest, 15, seed=0)]
    with pytest.raises(ValueError, match="collection of question ids, got the string 'user-1'"):
        load_dataset("jsonl", "test", path=user_file, exclude="user-1")


def test_load_dataset_rejects_bad_noise_before_reading(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="label_noise must be a number in \\[0, 1\\), got 1.0"):
        load_dataset("jsonl", "test", path=tmp_path / "does-not-exist.jsonl", label_noise=1.0)
