"""Your own multiple-choice questions, one JSON object per line (JSON Lines, UTF-8).

Format of each non-blank line (blank lines are skipped)::

    {"question": "Which gas do plants absorb?", "options": ["Oxygen", "Carbon dioxide", "Helium"], "answer": "B"}
    {"question": "2 + 2 = ?", "options": {"A": "3", "B": "4"}, "answer": 1, "context": "Arithmetic.", "id": "q2"}

- ``question`` (required): a non-empty string.
- ``options`` (required): either a list of 2 to 26 strings, shown as options A, B, C, ... in list
  order, or an object whose keys are consecutive capital letters starting at ``"A"`` (``"A"``, ``"B"``,
  ...; no gaps, any key order) with string values.
- ``answer`` (required): the correct option, either as its capital letter (``"B"``) or as its
  0-based integer index (``1`` means the second option, B). It must name one of the options.
- ``context`` (optional): a string passage the question is about; null or empty means none.
- ``id`` (optional): a string (or integer, converted to a string) carried through to predictions;
  by default ``"<file name without extension>-<n>"``, n being the 0-based index of the question in the file.
- ``meta`` (optional): an object, copied into the question's metadata. Other keys are ignored.

A malformed line raises ``DatasetError`` with the message ``"<file>:<line>: <what is wrong>"``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ibedl.core.prompt import LETTERS, MCQuestion
from ibedl.training.data.reading import Where, context_or_none, iter_jsonl, letter_index


def parse_jsonl_record(record: Any, where: Where, *, default_id: str) -> MCQuestion:
    """Turn one line of a generic question file into an MCQuestion (format: see the module docstring).

    Raises:
        DatasetError: the record is malformed.
    """
    record = where.obj(record)
    question = where.field(record, "question")
    raw_options = where.field(record, "options", (list, dict))
    if isinstance(raw_options, dict):
        keys = sorted(raw_options, key=lambda k: (len(k), k))
        expected = list(LETTERS[: len(keys)])
        if keys != expected:
            raise where.error(
                f"option keys must be consecutive capital letters from 'A' ({', '.join(expected) or 'none'}),"
                f" got {', '.join(map(repr, raw_options))}"
            )
        options = [raw_options[k] for k in expected]
    else:
        options = list(raw_options)
    for i, text in enumerate(options):
        if not isinstance(text, str):
            raise where.error(f"option {LETTERS[i] if i < len(LETTERS) else i} must be a string, got {text!r}")

    raw_answer = where.field(record, "answer", (str, int))
    n = len(options)
    if isinstance(raw_answer, str):
        answer = letter_index(raw_answer, n)
        if answer is None and n >= 2:
            hint = "; an integer answer is a 0-based index" if raw_answer.strip().isdigit() else ""
            raise where.error(
                f"answer {raw_answer!r} is not the letter of one of the {n} options"
                f" (A..{LETTERS[min(n, len(LETTERS)) - 1]}){hint}"
            )
    else:
        if not 0 <= raw_answer < n and n >= 2:
            raise where.error(f"answer {raw_answer} is not a 0-based index of one of the {n} options (0..{n - 1})")
        answer = raw_answer if 0 <= raw_answer < n else None

    context = record.get("context")
    if context is not None and not isinstance(context, str):
        raise where.error(f"'context' must be a string or null, got {type(context).__name__}")
    qid = record.get("id", default_id)
    if isinstance(qid, int) and not isinstance(qid, bool):
        qid = str(qid)
    if not isinstance(qid, str):
        raise where.error(f"'id' must be a string, got {qid!r}")
    extra = record.get("meta", {})
    if not isinstance(extra, dict):
        raise where.error(f"'meta' must be an object, got {type(extra).__name__}")
    return where.question(question, options, answer, context=context_or_none(context), id=qid, meta={**extra})


def read_jsonl_file(path: str | Path) -> list[MCQuestion]:
    """Read a generic question file (format: see the module docstring), in file order.

    Args:
        path: the JSONL file.

    Returns:
        The questions.

    Raises:
        DatasetError: the file is missing or a line is malformed (the message gives the line).
    """
    path = Path(path)
    return [
        parse_jsonl_record(value, Where(path, line), default_id=f"{path.stem}-{n}")
        for n, (line, value) in enumerate(iter_jsonl(path, in_data_dir=False))
    ]
