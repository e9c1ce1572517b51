"""SciQ: a JSON array of crowd-sourced science questions with three distractors and a support passage.

Each element: ``{"question", "distractor1", "distractor2", "distractor3", "correct_answer", "support"}``.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from ibedl.core.prompt import MCQuestion
from ibedl.training.data.errors import DatasetError
from ibedl.training.data.reading import Where, context_or_none, parse_json, read_text

# canonical split -> file, relative to the data directory
SCIQ_FILES = {
    "train": "sciq/train.json",
    "validation": "sciq/valid.json",
    "test": "sciq/test.json",
}

_FIELDS = ("distractor1", "distractor2", "distractor3", "correct_answer")


def option_order(split: str, index: int) -> list[int]:
    """The seeded placement of one question's options.

    Args:
        split: the split name used in the seed.
        index: the question's position in its file.

    Returns:
        A permutation of ``0..3``: position ``p`` shows field ``_FIELDS[order[p]]`` (3 = the correct
        answer). It depends only on (split, index), never on which other questions are loaded.
    """
    order = [0, 1, 2, 3]
    random.Random(f"sciq:{split}:{index}").shuffle(order)
    return order


def parse_sciq_record(record: Any, where: Where, *, split: str, index: int) -> MCQuestion:
    """Turn one SciQ element into an MCQuestion with the options in their seeded order.

    ``id`` is ``f"sciq-{split}-{index}"``; ``context`` is the support passage, None when empty.
    When the correct answer's text equals a distractor's (a few SciQ items do: "hydrogen" twice),
    ``meta["ambiguous"]`` is True: the question is kept, but two options read the same.

    Raises:
        DatasetError: the element is malformed.
    """
    record = where.obj(record, "element")
    question = where.field(record, "question")
    texts = [where.field(record, key) for key in _FIELDS]
    support = record.get("support")
    if support is not None and not isinstance(support, str):
        raise where.error(f"'support' must be a string, got {type(support).__name__}")
    order = option_order(split, index)
    options = [texts[k] for k in order]
    meta: dict = {"dataset": "sciq", "split": split}
    folded = [t.strip().casefold() for t in texts]
    if folded.count(folded[3]) > 1:
        meta["ambiguous"] = True
    return where.question(
        question, options, order.index(3), context=context_or_none(support), id=f"sciq-{split}-{index}", meta=meta
    )


def read_sciq_file(path: str | Path, *, split: str, in_data_dir: bool = False) -> list[MCQuestion]:
    """Read a SciQ JSON file, keeping the array order.

    Args:
        path: the JSON file (an array of objects).
        split: the split name, used in ids and in the option-placement seed.
        in_data_dir: whether the file was looked for in the data directory (for the message if missing).

    Returns:
        The questions.

    Raises:
        DatasetError: the file is missing, not a JSON array, or an element is malformed
            (the message gives the element's 0-based index).
    """
    path = Path(path)
    data = parse_json(path, read_text(path, in_data_dir=in_data_dir))
    if not isinstance(data, list):
        raise DatasetError(path, f"expected a JSON array of questions, got {type(data).__name__}")
    return [
        parse_sciq_record(record, Where(path, item=f"element {i}"), split=split, index=i)
        for i, record in enumerate(data)
    ]


def load_sciq(root: Path, split: str) -> list[MCQuestion]:
    """SciQ from the data directory `root` (split: train, validation, test)."""
    return read_sciq_file(root / SCIQ_FILES[split], split=split, in_data_dir=True)
