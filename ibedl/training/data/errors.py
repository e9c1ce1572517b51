"""The error raised for a dataset file that is missing or malformed."""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "IBEDL_DATA_DIR"


class DatasetError(ValueError):
    """A dataset file is missing or one of its records is malformed.

    The message always starts with the file, then where in it when known:
    ``"{path}:{line}: {problem}"`` for line-oriented files (JSONL, CSV),
    ``"{path}: element 3: {problem}"`` for a JSON array, ``"{path}: question 2: {problem}"``
    for a RACE passage file.

    Attributes:
        path: the file (or directory) concerned.
        line: 1-based line number, when the file is line-oriented.
        item: the record within the file, when not given by the line ("element 3", "row 5").
        problem: what is wrong, without the location.
    """

    def __init__(
        self, path: str | os.PathLike[str], problem: str, *, line: int | None = None, item: str | None = None
    ) -> None:
        self.path = Path(path)
        self.line = line
        self.item = item
        self.problem = problem
        location = str(self.path) if line is None else f"{self.path}:{line}"
        if item is not None:
            location = f"{location}: {item}"
        super().__init__(f"{location}: {problem}")

    def __reduce__(self):  # keep the exception picklable (multiprocessing data loaders)
        return (_rebuild, (str(self.path), self.problem, self.line, self.item))


def _rebuild(path: str, problem: str, line: int | None, item: str | None) -> DatasetError:
    return DatasetError(path, problem, line=line, item=item)


def missing_file(path: str | os.PathLike[str], *, in_data_dir: bool = True) -> DatasetError:
    """The error for a dataset file or directory that does not exist.

    Args:
        path: the path that was looked for.
        in_data_dir: whether the path was derived from the data directory, in which case the
            message says how to point the loaders at another one.

    Returns:
        A DatasetError naming the path (and, for data-directory files, IBEDL_DATA_DIR).
    """
    problem = "not found"
    if in_data_dir:
        from ibedl.core.paths import PathSettings

        current = PathSettings().data_dir
        now = f"set to {current!r}" if current else "not set"
        problem += (
            f"; set {DATA_DIR_ENV} (or pass data_dir=...) to the directory that holds the datasets"
            f" ({DATA_DIR_ENV} is {now})"
        )
    return DatasetError(path, problem)
