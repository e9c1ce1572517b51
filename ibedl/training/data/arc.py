"""ARC-Easy, ARC-Challenge and OpenBookQA: AI2's multiple-choice JSONL format.

Each line: ``{"id", "question": {"stem", "choices": [{"text", "label"}, ...]}, "answerKey"}``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ibedl.core.prompt import MCQuestion
from ibedl.training.data.reading import Where, iter_jsonl

# canonical split -> file, relative to the data directory (Dev/dev serves as validation)
ARC_EASY_FILES = {
    "train": "arc_easy/ARC-Easy-Train.jsonl",
    "validation": "arc_easy/ARC-Easy-Dev.jsonl",
    "test": "arc_easy/ARC-Easy-Test.jsonl",
}
ARC_CHALLENGE_FILES = {
    "train": "arc_challenge/ARC-Challenge-Train.jsonl",
    "validation": "arc_challenge/ARC-Challenge-Dev.jsonl",
    "test": "arc_challenge/ARC-Challenge-Test.jsonl",
}
OBQA_FILES = {
    "train": "obqa/train.jsonl",
    "validation": "obqa/dev.jsonl",
    "test": "obqa/test.jsonl",
}


def parse_choice_record(record: Any, where: Where, *, meta: dict) -> MCQuestion:
    """Turn one AI2-format record (ARC, OBQA, CommonsenseQA) into an MCQuestion.

    Options keep the order of ``choices`` in the record; labels may be letters (``"A"``..) or
    digits (``"1"``..): the answer is the position of the choice whose label equals ``answerKey``.
    The original labels are kept in ``meta["labels"]``.

    Args:
        record: the parsed JSON value of one line.
        where: the record's location, for error messages.
        meta: extra metadata for the question (dataset, split).

    Returns:
        The question, with its ``id``.

    Raises:
        DatasetError: the record is malformed.
    """
    record = where.obj(record)
    qid = where.field(record, "id")
    body = where.obj(where.field(record, "question", dict), "'question'")
    stem = where.field(body, "stem", parent="question.")
    choices = where.field(body, "choices", list, parent="question.")
    texts: list[str] = []
    labels: list[str] = []
    for k, choice in enumerate(choices):
        choice = where.obj(choice, f"question.choices[{k}]")
        texts.append(where.field(choice, "text", parent=f"question.choices[{k}]."))
        labels.append(where.field(choice, "label", parent=f"question.choices[{k}]."))
    if len(set(labels)) != len(labels):
        raise where.error(f"choice labels are not unique: {labels}")
    key = where.field(record, "answerKey")
    if len(choices) >= 2 and key not in labels:
        raise where.error(f"answerKey {key!r} is not one of the choice labels {labels}")
    answer = labels.index(key) if key in labels else None
    return where.question(stem, texts, answer, id=qid, meta={**meta, "labels": tuple(labels)})


def read_choice_file(
    path: str | Path, *, dataset: str, split: str | None = None, in_data_dir: bool = False
) -> list[MCQuestion]:
    """Read an AI2-format JSONL file (ARC, OBQA), one question per non-blank line, in file order.

    Args:
        path: the JSONL file.
        dataset: the dataset name, stored in ``meta["dataset"]``.
        split: the canonical split name, stored in ``meta["split"]``.
        in_data_dir: whether the file was looked for in the data directory (for the message if missing).

    Returns:
        The questions.

    Raises:
        DatasetError: the file is missing or a line is malformed (the message gives the line).
    """
    path = Path(path)
    meta = {"dataset": dataset, "split": split}
    return [
        parse_choice_record(value, Where(path, line), meta=meta)
        for line, value in iter_jsonl(path, in_data_dir=in_data_dir)
    ]


def load_arc_easy(root: Path, split: str) -> list[MCQuestion]:
    """ARC-Easy from the data directory `root` (split: train, validation, test)."""
    return read_choice_file(root / ARC_EASY_FILES[split], dataset="arc_easy", split=split, in_data_dir=True)


def load_arc_challenge(root: Path, split: str) -> list[MCQuestion]:
    """ARC-Challenge from the data directory `root` (split: train, validation, test)."""
    return read_choice_file(root / ARC_CHALLENGE_FILES[split], dataset="arc_challenge", split=split, in_data_dir=True)


def load_obqa(root: Path, split: str) -> list[MCQuestion]:
    """OpenBookQA (main setting) from the data directory `root` (split: train, validation, test)."""
    return read_choice_file(root / OBQA_FILES[split], dataset="obqa", split=split, in_data_dir=True)
