"""The same labelled questions asked with another number of options: what a calibration needs to keep its promises
for option counts its data do not have (a gate on 1/u = alpha0 / C, a confidence threshold and a conformal quantile
all move with the count C).

A question asked with ``c`` options keeps its right answer and ``c - 1`` wrong ones: its own distractors first (a
seeded random subset when it has more than it needs), then wrong options borrowed from other questions of the same
sample when it has fewer; the options are shuffled (seeded), so the right answer's letter is uniform. Borrowed
options are other questions' options, never text equal to one already there.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

from ibedl.core.prompt import MAX_OPTIONS, MIN_OPTIONS, MCQuestion


def parse_counts(text: str) -> tuple[int, ...]:
    """``"2,3,4"`` -> (2, 3, 4): sorted, distinct, each in MIN_OPTIONS..MAX_OPTIONS; ValueError naming a bad one."""
    counts = set()
    for part in str(text).split(","):
        try:
            c = int(part)
        except ValueError:
            raise ValueError(f"option counts are integers separated by commas, got {part.strip()!r} in "
                             f"{text!r}") from None
        if not MIN_OPTIONS <= c <= MAX_OPTIONS:
            raise ValueError(f"an option count must be in {MIN_OPTIONS}..{MAX_OPTIONS}, got {c}")
        counts.add(c)
    return tuple(sorted(counts))


def with_options(q: MCQuestion, count: int, pool: Sequence[str], rng: random.Random) -> MCQuestion:
    """``q`` asked with ``count`` options: its answer, then its own distractors, then options drawn from ``pool``
    (other questions' option texts), shuffled. ValueError when it has no answer or the pool runs short."""
    if q.answer is None:
        raise ValueError(f"question {q.question[:60]!r} has no answer: its options cannot be varied")
    if not MIN_OPTIONS <= count <= MAX_OPTIONS:
        raise ValueError(f"an option count must be in {MIN_OPTIONS}..{MAX_OPTIONS}, got {count}")
    right = q.options[q.answer]
    own = [o for i, o in enumerate(q.options) if i != q.answer]
    wrong = rng.sample(own, count - 1) if len(own) >= count - 1 else list(own)
    seen = {o.strip().lower() for o in (right, *wrong)}
    for _ in range(100 * count):
        if len(wrong) == count - 1:
            break
        candidate = pool[rng.randrange(len(pool))]
        if candidate.strip().lower() not in seen:
            wrong.append(candidate)
            seen.add(candidate.strip().lower())
    if len(wrong) < count - 1:
        raise ValueError(f"not enough distinct wrong options to ask {q.question[:60]!r} with {count} options")
    options = [right, *wrong]
    rng.shuffle(options)
    meta = {**q.meta, "options_from": len(q.options)}
    return dataclasses.replace(q, options=tuple(options), answer=options.index(right), meta=meta)


def vary_option_counts(questions: Sequence[MCQuestion], counts: Sequence[int], per_count: int | None = None,
                       seed: int = 0) -> list[MCQuestion]:
    """Every question at its own count when that count is in ``counts``, and for each other count a seeded subset of
    ``per_count`` questions (all when None) asked with that many options (:func:`with_options`), in count order.
    Ids get a ``@<count>`` suffix when a question is varied."""
    if not questions:
        raise ValueError("vary_option_counts needs at least one question")
    if per_count is not None and per_count < 1:
        raise ValueError(f"per_count must be >= 1, got {per_count}")
    rng = random.Random(seed)
    pool = [o for q in questions for o in q.options]
    out: list[MCQuestion] = []
    for count in sorted(set(counts)):
        own = [q for q in questions if len(q.options) == count]
        out += own
        others = [q for q in questions if len(q.options) != count]
        if not others:
            continue
        chosen = others if per_count is None or per_count >= len(others) else rng.sample(others, per_count)
        for q in chosen:
            varied = with_options(q, count, pool, rng)
            out.append(dataclasses.replace(varied, id=None if q.id is None else f"{q.id}@{count}"))
    return out


__all__ = ["parse_counts", "with_options", "vary_option_counts"]
