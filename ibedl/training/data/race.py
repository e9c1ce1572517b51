"""RACE: English reading-comprehension exams (middle and high school), one JSON file per passage.

Layout: ``race/RACE/{train,dev,test}/{high,middle}/*.txt``; each file is one JSON object
``{"article", "questions": [...], "options": [[4 str], ...], "answers": ["B", ...], "id"}``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ibedl.core.prompt import MCQuestion
from ibedl.training.data.errors import DatasetError, missing_file
from ibedl.training.data.reading import Where, letter_index

# canonical split -> directory, relative to the data directory (dev serves as validation)
RACE_DIRS = {
    "train": "race/RACE/train",
    "validation": "race/RACE/dev",
    "test": "race/RACE/test",
}
LEVELS = ("high", "middle")


def parse_race_passage(record: Any, path: Path, *, split: str | None, level: str | None) -> list[MCQuestion]:
    """Turn one RACE passage into its questions.

    Each question gets the article as ``context`` and the id ``f"{file id}-{k}"`` (k: 0-based question
    index in the file); ``meta["level"]`` is "high" or "middle".

    Args:
        record: the parsed JSON object of one passage file.
        path: the file, for error messages.
        split: the canonical split name, stored in ``meta["split"]``.
        level: the school level, stored in ``meta["level"]``.

    Returns:
        The passage's questions, in file order.

    Raises:
        DatasetError: the passage is malformed (the message gives the file and the question index).
    """
    where = Where(path)
    record = where.obj(record)
    article = where.field(record, "article")
    passage_id = where.field(record, "id")
    questions = where.field(record, "questions", list)
    options = where.field(record, "options", list)
    answers = where.field(record, "answers", list)
    if not len(questions) == len(options) == len(answers):
        raise where.error(
            f"{len(questions)} questions, {len(options)} option lists and {len(answers)} answers: counts differ"
        )
    meta = {"dataset": "race", "split": split, "level": level}
    out = []
    for k, (question, opts, letter) in enumerate(zip(questions, options, answers, strict=False)):
        at = Where(path, item=f"question {k}")
        if not isinstance(question, str):
            raise at.error(f"the question must be a string, got {type(question).__name__}")
        if not isinstance(opts, list):
            raise at.error(f"the options must be a list, got {type(opts).__name__}")
        if not isinstance(letter, str):
            raise at.error(f"the answer must be a letter, got {letter!r}")
        answer = letter_index(letter, len(opts))
        if answer is None and len(opts) >= 2:
            raise at.error(f"answer {letter!r} is not the letter of one of its {len(opts)} options")
        out.append(at.question(question, opts, answer, context=article, id=f"{passage_id}-{k}", meta=dict(meta)))
    return out


def read_race_dir(directory: str | Path, *, split: str | None = None, in_data_dir: bool = False) -> list[MCQuestion]:
    """Read every ``*.txt`` passage under ``directory/high`` and ``directory/middle``.

    Files are read in sorted order: all of ``high`` (file names sorted as strings), then ``middle``.

    Args:
        directory: a split directory (``.../RACE/dev``).
        split: the canonical split name, stored in ``meta["split"]``.
        in_data_dir: whether the directory was looked for in the data directory (for the message if missing).

    Returns:
        The questions of every passage, in file order.

    Raises:
        DatasetError: a level directory is missing, or a file is malformed.
    """
    directory = Path(directory)
    out: list[MCQuestion] = []
    for level in LEVELS:
        level_dir = directory / level
        try:
            with os.scandir(level_dir) as entries:
                names = sorted(e.name for e in entries if e.name.endswith(".txt") and e.is_file())
        except FileNotFoundError:
            raise missing_file(level_dir, in_data_dir=in_data_dir) from None
        for name in names:
            path = level_dir / name
            with open(path, "rb") as f:
                data = f.read()
            out.extend(parse_race_passage(_parse(path, data), path, split=split, level=level))
    return out


def load_race(root: Path, split: str) -> list[MCQuestion]:
    """RACE (high and middle together) from the data directory `root` (split: train, validation, test)."""
    return read_race_dir(root / RACE_DIRS[split], split=split, in_data_dir=True)


def _parse(path: Path, data: bytes) -> Any:
    try:
        return json.loads(data.decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise DatasetError(path, f"not valid UTF-8 (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise DatasetError(path, f"invalid JSON: {e.msg} (column {e.colno})", line=e.lineno) from None
