"""Helpers shared by the loaders: reading files, locating records, checking fields."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ibedl.core.prompt import LETTERS, MCQuestion
from ibedl.training.data.errors import DatasetError, missing_file


def read_text(path: Path, *, in_data_dir: bool = True) -> str:
    """Read a UTF-8 text file (a leading byte-order mark is dropped).

    Args:
        path: the file.
        in_data_dir: passed to `missing_file` for the message of a missing file.

    Returns:
        The file's text.

    Raises:
        DatasetError: the file is missing, is a directory, or is not UTF-8.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise missing_file(path, in_data_dir=in_data_dir) from None
    except IsADirectoryError:
        raise DatasetError(path, "is a directory, expected a file") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise DatasetError(path, f"not valid UTF-8 (byte {e.start})", line=line) from None


def parse_json(path: Path, text: str) -> Any:
    """Parse a whole file as one JSON value, reporting the line of a syntax error."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DatasetError(path, f"invalid JSON: {e.msg} (column {e.colno})", line=e.lineno) from None


def iter_jsonl(path: Path, *, in_data_dir: bool = True) -> Iterator[tuple[int, Any]]:
    """Yield ``(line number, value)`` for each non-blank line of a JSON Lines file.

    Raises:
        DatasetError: the file is missing or a line is not valid JSON.
    """
    text = read_text(path, in_data_dir=in_data_dir)
    # split on "\n" only: str.splitlines() would also split inside strings holding U+2028 and the like
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(path, f"invalid JSON: {e.msg} (column {e.colno})", line=lineno) from None
        yield lineno, value


@dataclass(frozen=True)
class Where:
    """Where a record is: its file and, as known, its line or its position in the file."""

    path: Path
    line: int | None = None
    item: str | None = None

    def error(self, problem: str) -> DatasetError:
        """A DatasetError located here."""
        return DatasetError(self.path, problem, line=self.line, item=self.item)

    def obj(self, value: Any, what: str = "record") -> dict:
        """Check that `value` is a JSON object and return it."""
        if not isinstance(value, dict):
            raise self.error(f"{what} must be a JSON object, got {_kind(value)}")
        return value

    def field(self, record: dict, key: str, kind: type | tuple[type, ...] = str, *, parent: str = "") -> Any:
        """Return ``record[key]``, checking that it is present and of the expected JSON type.

        Args:
            record: the JSON object.
            key: the required key.
            kind: the accepted Python type(s); a bool is never accepted for an int.
            parent: a prefix for the key in messages (``"question."``).
        """
        if key not in record:
            raise self.error(f"missing key {parent + key!r}")
        value = record[key]
        if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
            raise self.error(f"{parent + key!r} must be {_expected(kind)}, got {_kind(value)}")
        return value

    def question(
        self,
        question: str,
        options: list[str] | tuple[str, ...],
        answer: int | None,
        *,
        context: str | None = None,
        id: str | None = None,
        meta: dict | None = None,
    ) -> MCQuestion:
        """Build an MCQuestion, turning its validation errors into DatasetErrors located here."""
        if not question.strip():
            raise self.error("the question is empty")
        if len(options) < 2:
            raise self.error(f"a question needs at least 2 options, got {len(options)}")
        if len(options) > len(LETTERS):
            raise self.error(f"a question has at most {len(LETTERS)} options, got {len(options)}")
        for i, text in enumerate(options):
            if not isinstance(text, str):
                raise self.error(f"option {LETTERS[i]} must be a string, got {_kind(text)}")
        try:
            return MCQuestion(question, tuple(options), context, answer, id, meta if meta is not None else {})
        except ValueError as e:
            raise self.error(str(e)) from None


def letter_index(letter: str, num_options: int) -> int | None:
    """The 0-based index of option letter ``A``.. among `num_options`, or None if it is not one."""
    if len(letter) == 1 and letter in LETTERS[:num_options]:
        return LETTERS.index(letter)
    return None


def context_or_none(text: str | None) -> str | None:
    """A passage, or None when it is missing or blank."""
    return text if text is not None and text.strip() else None


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


_JSON_NAMES = {
    str: "a string", int: "an integer", float: "a number", list: "a list", dict: "an object", bool: "a boolean"
}


def _expected(kind: type | tuple[type, ...]) -> str:
    return " or ".join(_JSON_NAMES.get(k, k.__name__) for k in _as_tuple(kind))


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    for k in (str, int, float, list, dict):
        if isinstance(value, k):
            shown = repr(value)
            if len(shown) > 40:
                shown = shown[:37] + "..."
            return f"{_JSON_NAMES[k]} ({shown})" if k in (str, int, float) else _JSON_NAMES[k]
    return type(value).__name__
