"""Seeded subsets of a dataset and synthetic label noise (for robustness experiments)."""

from __future__ import annotations

import numbers
import random
from collections.abc import Sequence
from dataclasses import replace

from ibedl.core.prompt import MCQuestion


def subset(questions: Sequence[MCQuestion], limit: int | None, seed: int = 0) -> list[MCQuestion]:
    """A seeded random subset of `limit` questions, kept in their original order.

    The choice depends only on (number of questions, limit, seed): the same call returns the same
    questions in the same order, and a smaller limit picks a subset of what a larger one picks.

    Args:
        questions: the questions.
        limit: how many to keep; None (or at least ``len(questions)``) keeps them all, in order.
        seed: the seed of the choice.

    Returns:
        A new list.

    Raises:
        ValueError: `limit` is negative or not an integer.
    """
    if limit is None:
        return list(questions)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"limit must be a non-negative integer or None, got {limit!r}")
    n = len(questions)
    if limit >= n:
        return list(questions)
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return [questions[i] for i in sorted(order[:limit])]


def perturb_labels(questions: Sequence[MCQuestion], fraction: float, seed: int = 0) -> list[MCQuestion]:
    """Move the answer of a seeded random ``round(fraction * n)`` of the questions to another option.

    Each chosen question's answer becomes an option drawn uniformly among its other options; such a
    question carries ``meta["noisy_label"] = True`` and ``meta["clean_answer"]`` (its original answer).
    Perturbing already perturbed questions keeps the first ``clean_answer`` (and ``noisy_label`` then
    says whether the answer differs from it). The other questions are returned unchanged.

    Args:
        questions: the questions; every one needs an answer.
        fraction: the fraction of labels to change, in [0, 1).
        seed: the seed of which questions change and to what.

    Returns:
        A new list, in the same order.

    Raises:
        ValueError: `fraction` is outside [0, 1), or a question has no answer.
    """
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real) or not 0 <= fraction < 1:
        raise ValueError(f"label noise fraction must be a number in [0, 1), got {fraction!r}")
    out = list(questions)
    for q in out:
        if q.answer is None:
            raise ValueError(f"cannot add label noise to question {q.id!r}: it has no answer")
    rng = random.Random(seed)
    for i in sorted(rng.sample(range(len(out)), round(fraction * len(out)))):
        q = out[i]
        new = rng.choice([j for j in range(q.num_options) if j != q.answer])
        clean = q.meta.get("clean_answer", q.answer)
        meta = {**q.meta, "noisy_label": new != clean, "clean_answer": clean}
        out[i] = replace(q, answer=new, meta=meta)
    return out
